"""A draft service's scheduler running on the test's event loop, stopped when the block ends."""
from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from draft_service.metrics import DraftMetrics
from draft_service.scheduler import DraftScheduler, Limits


@asynccontextmanager
async def running_scheduler(drafter, metrics: DraftMetrics, limits: Limits, **options) -> AsyncIterator[DraftScheduler]:
    scheduler = DraftScheduler(drafter, metrics, limits, **options)
    scheduler.start()
    try:
        yield scheduler
    finally:
        await scheduler.stop()
