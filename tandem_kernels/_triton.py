"""Triton where it can launch (a GPU, or its interpreter): elsewhere the PyTorch references run."""
from __future__ import annotations

import os
from typing import Callable

import torch

# Imported only where it can launch (a GPU, or its interpreter), or where TANDEM_TRITON=1 asks for
# its compiler (compiling for a GPU elsewhere): 90 MB resident on a CPU server.
try:
    if not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
            or os.environ.get("TANDEM_TRITON") == "1"):
        raise ImportError("no GPU, no interpreter, and no TANDEM_TRITON=1")
    import triton
    import triton.language as tl
except ImportError:
    triton = None
    tl = None


def jit(**options) -> Callable:
    """`triton.jit(**options)`, or a no-op where triton is missing (the function is never launched)."""
    if triton is None:
        return lambda fn: fn
    return triton.jit(**options)


# Triton chooses interpreter or compiler when a kernel is decorated, i.e. when tandem_kernels/ is imported.
INTERPRETED = triton is not None and os.environ.get("TRITON_INTERPRET") == "1"


def constexpr(value):
    """A module-level constant kernels may read: `tl.constexpr(value)`, or the value without triton."""
    return value if tl is None else tl.constexpr(value)


def require_triton() -> None:
    """Fail clearly when a kernel launch is asked for without triton."""
    if triton is None:
        raise RuntimeError("triton is not installed: CUDA tensors need it (pip install 'triton>=3.6')")


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (and >= 1), for constexpr block sizes."""
    return 1 << max(n - 1, 0).bit_length()
