"""What a loader raises for a checkpoint it cannot read."""
from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint is missing files or tensors, or does not fit its config."""
