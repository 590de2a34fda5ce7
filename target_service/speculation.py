"""How long a step may wait for drafts: only as long as the drafts are expected to pay for it."""
from __future__ import annotations

from target_service.config import TargetConfig

_SMOOTHING = 0.1  # weight of the newest observation in the moving averages


class SpeculationPolicy:
    """Waiting w seconds pays off when the tokens the drafts are expected to add, E[accepted],
    each saving about one step, are worth more than w. So the bound is E[accepted] * step time,
    capped by --draft-wait-ms, and it shrinks to nothing for a drafter whose drafts are rejected."""

    def __init__(self, config: TargetConfig):
        self.max_wait = config.draft_wait_ms / 1000.0
        self.sync = config.sync_speculation
        self.mean_accepted = 1.0  # optimistic until measured, so that a new drafter gets a chance
        self.mean_step = self.max_wait

    def observe_verify(self, num_accepted: int) -> None:
        self.mean_accepted += _SMOOTHING * (num_accepted - self.mean_accepted)

    def observe_step(self, seconds: float) -> None:
        self.mean_step += _SMOOTHING * (seconds - self.mean_step)

    def wait_bound(self) -> float:
        if self.sync:
            return 1.0  # synchronous speculation: wait for the drafter, bounded so a dead one can't stall us
        return min(self.max_wait, self.mean_accepted * self.mean_step)
