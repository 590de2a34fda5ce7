"""Argument checks shared by the kernel wrappers: fail with a message, never inside a kernel."""
from __future__ import annotations

from typing import Optional, Sequence

import torch


class KernelInputError(ValueError):
    """A tensor handed to a kernel wrapper has the wrong shape, dtype, device or layout."""


def check_tensor(
    name: str,
    tensor: torch.Tensor,
    dtype: torch.dtype,
    shape: Sequence[Optional[int]],
    device: torch.device,
) -> None:
    """Require dtype, rank, the sizes given (None = any), device, and a contiguous layout."""
    if not isinstance(tensor, torch.Tensor):
        raise KernelInputError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype != dtype:
        raise KernelInputError(f"{name}: expected dtype {dtype}, got {tensor.dtype}")
    if tensor.dim() != len(shape) or any(
        want is not None and got != want for got, want in zip(tensor.shape, shape)
    ):
        wanted = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise KernelInputError(f"{name}: expected shape {wanted}, got {list(tensor.shape)}")
    if tensor.device != device:
        raise KernelInputError(f"{name}: expected device {device}, got {tensor.device}")
    if not tensor.is_contiguous():
        raise KernelInputError(f"{name}: must be contiguous")
