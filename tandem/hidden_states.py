"""The target's features on the wire (SequenceExtend.hidden_states): bf16 rows, one per position.

A feature row is the residual stream entering each layer a drafter named in its Info, as the target
read that position's token: [len(layers), hidden_size]. Both services use this module, so the two
ends agree on the layout and on the checks.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

BYTES_PER_VALUE = 2  # bfloat16


class FeatureError(ValueError):
    """Features that do not fit the layout or the Extend they came with."""


@dataclass(frozen=True, slots=True)
class FeatureLayout:
    layers: tuple[int, ...]  # target layers, ascending
    hidden_size: int

    @property
    def row_bytes(self) -> int:
        return len(self.layers) * self.hidden_size * BYTES_PER_VALUE

    def check_layers(self, num_layers: int) -> None:
        """FeatureError unless the layers are distinct, ascending and inside a target of num_layers."""
        layers = list(self.layers)
        if not layers or layers != sorted(set(layers)) or layers[-1] >= num_layers:
            raise FeatureError(f"hidden layers {layers} must be distinct, ascending and below the target's "
                               f"{num_layers} layers")

    def encode(self, rows: torch.Tensor) -> bytes:
        """rows [R, len(layers), hidden_size], any float dtype -> R * row_bytes bytes."""
        if rows.shape[1:] != (len(self.layers), self.hidden_size):
            raise FeatureError(f"feature rows of shape {tuple(rows.shape)}; the layout is "
                               f"[rows, {len(self.layers)}, {self.hidden_size}]")
        return rows.to(torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes()

    def decode(self, data: bytes, rows: int) -> torch.Tensor:
        """bf16 [rows, len(layers), hidden_size]; FeatureError when the byte count is not rows rows."""
        if len(data) != rows * self.row_bytes:
            raise FeatureError(f"{len(data)} bytes of hidden states; {rows} rows of {len(self.layers)} layers x "
                               f"{self.hidden_size} bf16 values are {rows * self.row_bytes}")
        if rows == 0:
            return torch.empty(0, len(self.layers), self.hidden_size, dtype=torch.bfloat16)
        flat = torch.frombuffer(bytearray(data), dtype=torch.int16)
        return flat.view(torch.bfloat16).view(rows, len(self.layers), self.hidden_size)


def extend_feature_rows(start: int, num_tokens: int, hidden_start: int) -> int:
    """How many feature rows an Extend of num_tokens tokens from `start` carries from hidden_start on:
    positions hidden_start .. start + num_tokens - 2. FeatureError when hidden_start is past them."""
    end = start + num_tokens - 1
    if not 0 <= hidden_start < end:
        raise FeatureError(f"hidden_start={hidden_start} must be below start + len(token_ids) - 1 = {end}: "
                           f"the last committed token has no feature yet")
    return end - hidden_start
