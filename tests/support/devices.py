"""The devices a Triton kernel's tests run on: the CPU under TRITON_INTERPRET=1, and CUDA where there is one."""
from __future__ import annotations

import pytest
import torch


def triton_devices(interpreted: bool) -> list:
    """pytest params "cpu" (only when the kernels run interpreted) and "cuda" (marked gpu)."""
    return [
        pytest.param("cpu", marks=pytest.mark.skipif(not interpreted, reason="kernels are compiled for CUDA here")),
        pytest.param(
            "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
        ),
    ]


def native_builds() -> list[str]:
    """The native CPU decoder builds this CPU runs (none off x86 or without gcc)."""
    from tandem.model import native

    return [isa.name for isa in native.runnable_isas()] if native.load() is not None else []


needs_native = pytest.mark.skipif(not native_builds(), reason="no x86 CPU with AVX2, or no gcc")
