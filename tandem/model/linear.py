"""Linear layers whose weight layout suits the device: packed panels on x86 CPUs, F.linear elsewhere."""
from __future__ import annotations

from typing import Literal, Protocol

import torch
import torch.nn.functional as F

from tandem.model import cpu_gemm

LinearBackend = Literal["auto", "torch"]  # auto: the packed CPU kernel where it runs; torch: F.linear


class Linear(Protocol):
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """[T, in] -> [T, out], in x's dtype."""

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Weight rows [T, in]: an embedding lookup, for a tied lm_head."""


class DenseLinear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.weight = weight  # [out, in]
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class PackedLinear:
    """fp32 or bf16 weights in cpu_gemm's panels; fp32 accumulation, output rounded to x's dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, gemm: cpu_gemm.Gemm):
        self.out_features = weight.shape[0]
        self.packed = cpu_gemm.pack(weight)  # [ceil(out / 16), in, 16]
        self.bias = None if bias is None else bias.float()
        self._gemm = gemm

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self._gemm(x.float().contiguous(), self.packed)  # [T, padded out], fp32
        if y.shape[1] != self.out_features:
            y = y[:, : self.out_features]
        if self.bias is not None:
            y += self.bias
        return y.to(x.dtype)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return cpu_gemm.packed_rows(self.packed, ids)


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None = None,
                backend: LinearBackend = "auto") -> Linear:
    """weight: [out, in] on its final device and dtype."""
    if backend == "auto" and cpu_gemm.supports(weight):
        gemm = cpu_gemm.load()
        if gemm is not None:
            return PackedLinear(weight, bias, gemm)
    return DenseLinear(weight, bias)
