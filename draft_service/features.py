"""The target's features of each sequence, for a drafter that reads them (EAGLE-3 style).

Extends bring them (tandem.hidden_states); the event loop writes them here, and the drafter's thread
reads the rows of positions below `known`, so a round drafts from the features that had arrived
when it started. Positions the target never sent (features of tokens committed before a reconnect)
are zeros.
"""
from __future__ import annotations

import torch

from tandem.hidden_states import FeatureLayout

_INITIAL_ROWS = 256


class SequenceFeatures:
    def __init__(self, layout: FeatureLayout):
        self.rows = torch.zeros(_INITIAL_ROWS, len(layout.layers), layout.hidden_size, dtype=torch.bfloat16)
        self.known = 0  # positions [0, known) have their feature (zeros where none came)

    def rollback(self, length: int) -> None:
        """Tokens from position `length` on changed: the features of those positions no longer hold."""
        self.known = min(self.known, length)

    def write(self, first: int, rows: torch.Tensor) -> None:
        """Rows [R, layers, hidden] of positions first.. ; a gap before first is filled with zeros."""
        end = first + len(rows)
        if end > len(self.rows):
            grown = torch.zeros(max(end, 2 * len(self.rows)), *self.rows.shape[1:], dtype=self.rows.dtype)
            grown[: self.known] = self.rows[: self.known]
            self.rows = grown  # a round reading the old tensor keeps it
        if first > self.known:
            self.rows[self.known : first] = 0
        self.rows[first:end] = rows
        self.known = end
