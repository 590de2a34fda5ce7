"""Fixtures of the model tests."""
from __future__ import annotations

import pytest

from tandem.model import native
from tests.support.devices import native_builds


@pytest.fixture(params=native_builds())
def isa(request, monkeypatch):
    """Each native decoder build this CPU runs, chosen the way a user would: TANDEM_NATIVE_ISA."""
    monkeypatch.setenv("TANDEM_NATIVE_ISA", request.param)
    native.load.cache_clear()
    yield native.load()
    native.load.cache_clear()
