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
