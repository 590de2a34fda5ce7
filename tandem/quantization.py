"""--quantization: which weight matrices the native CPU decoder multiplies in GGUF blocks.

auto runs a GGUF in its own block types (docs/design/runtime.md, Quantized weights); none
dequantizes every matrix to the compute dtype (--dtype), as before; q8_0 and q4_0 quantize the
float matrices of any checkpoint (an HF folder, a float GGUF, a drafter file) at load.
"""
from __future__ import annotations

import logging
from collections import Counter

import torch
from gguf import GGMLQuantizationType

from tandem.config import ModelConfig
from tandem.model import native
from tandem.model.block_matrix import BlockMatrix
from tandem.model.llama import Matrix, ModelWeights, dequantized
from tandem.model.native_decoder import BLOCK_ACTIVATIONS, check_block_activations  # re-exported for the flags
from tandem.model.native_decoder import supports as native_supports

log = logging.getLogger(__name__)

QUANTIZATIONS = ("auto", "none", "q8_0", "q4_0")
QUANTIZATION_HELP = ("auto, none, q8_0 or q4_0: auto runs a GGUF's Q4_0, Q4_1, Q8_0, Q4_K, Q5_K and Q6_K matrices "
                     "in their blocks, in "
                     "the native CPU decoder (the embedded model's default); none dequantizes them to --dtype; "
                     "q8_0 and q4_0 quantize a checkpoint's float matrices at load (CPU only)")
_AT_LOAD = {"q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0}
BLOCK_ACTIVATIONS_HELP = ("int16 or int8: what the native CPU decoder quantizes a block matrix's inputs to, per "
                          "block of 32. int16 (the default) keeps transformers' greedy text on the dequantized GGUF; "
                          "int8, as llama.cpp does, multiplies four bytes per instruction (VNNI) for a faster "
                          "verify and batch, at a KL divergence about 15 times bf16's (docs/design/runtime.md)")


def check_quantization(name: str) -> None:
    if name not in QUANTIZATIONS:
        raise ValueError(f"quantization {name!r} is not one of: {', '.join(QUANTIZATIONS)}")


def keeps_blocks(name: str, device: torch.device) -> bool:
    """Whether a GGUF's block matrices should be loaded as blocks: only the native CPU decoder runs them."""
    check_quantization(name)
    return name != "none" and device.type == "cpu" and native.load() is not None


def quantize(weights: ModelWeights, name: str, config: ModelConfig, dtype: torch.dtype,
             device: torch.device) -> ModelWeights:
    """The weights as `name` asks: auto keeps a checkpoint's blocks (and puts any float matrix beside
    them in Q8_0), none makes every matrix float, q8_0 / q4_0 quantize the float ones."""
    check_quantization(name)
    if name == "none" or (name == "auto" and not weights.in_blocks):
        return dequantized(weights)
    if not native_supports(config, dtype, device, blocks=True):
        if name == "auto":
            return dequantized(weights)
        raise ValueError(f"--quantization {name} runs on the native CPU decoder, which can't run this model on "
                         f"{device} (it needs an x86 CPU with AVX2, gcc, and widths that are multiples of 32): "
                         f"use --quantization none")
    target = _AT_LOAD.get(name, GGMLQuantizationType.Q8_0)

    def in_blocks(matrix: Matrix) -> BlockMatrix:
        return matrix if isinstance(matrix, BlockMatrix) else BlockMatrix.quantized(matrix, target)

    weights = weights.map_matrices(in_blocks)
    _describe(weights)
    return weights


def _describe(weights: ModelWeights) -> None:
    matrices = {id(m): m for m in weights.matrices}.values()  # a tied head counted once
    types = Counter(part.ggml_type.name for m in matrices for part in m.parts)
    size = sum(m.nbytes for m in matrices)
    log.info("weights in GGUF blocks: %s (%.0f MB)", ", ".join(f"{n} x{c}" for n, c in types.most_common()),
             size / 1e6)
