"""Builds ModelWeights from per-layer tensors, whatever file format they came from."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from tandem.config import ModelConfig
from tandem.loaders.errors import CheckpointError
from tandem.model.block_matrix import BlockMatrix
from tandem.model.llama import LayerWeights, Matrix, ModelWeights


# Canonical tensor roles; each loader maps its own names onto these.
LAYER_ROLES = ("attn_norm", "q", "k", "v", "q_bias", "k_bias", "v_bias", "o", "mlp_norm", "gate", "up", "down")


def assemble_weights(
    config: ModelConfig,
    get: Callable[[str, int | None], Matrix | None],
    rope_inv_freq: torch.Tensor | None = None,
) -> ModelWeights:
    """`get(role, layer)` returns a float32 tensor (or, for a matrix, GGUF blocks), or None when the
    checkpoint lacks it."""

    def need(role: str, layer: int | None = None) -> Matrix:
        tensor = get(role, layer)
        if tensor is None:
            where = f" of layer {layer}" if layer is not None else ""
            raise CheckpointError(f"checkpoint has no {role!r} tensor{where}")
        return tensor

    layers = []
    for i in range(config.num_layers):
        qkv_bias = None
        if config.attention_bias:
            qkv_bias = _concat([need("q_bias", i), need("k_bias", i), need("v_bias", i)])
        layers.append(
            LayerWeights(
                attn_norm=need("attn_norm", i),
                qkv=_concat([need("q", i), need("k", i), need("v", i)]),
                qkv_bias=qkv_bias,
                o=need("o", i),
                mlp_norm=need("mlp_norm", i),
                gate_up=_concat([need("gate", i), need("up", i)]),
                down=need("down", i),
            )
        )
    embed = need("embed")
    lm_head = get("lm_head", None)
    if lm_head is None or config.tie_word_embeddings:
        lm_head = embed
    weights = ModelWeights(embed=embed, layers=layers, norm=need("norm"), lm_head=lm_head, rope_inv_freq=rope_inv_freq)
    _check_shapes(config, weights)
    return weights


def _concat(parts: list[Matrix]) -> Matrix:
    if all(isinstance(part, BlockMatrix) for part in parts):
        return BlockMatrix.cat(parts)
    parts = [part.dequantize() if isinstance(part, BlockMatrix) else part for part in parts]
    # numpy copies on one thread; torch.cat's intra-op threads took 10x longer on a busy 2-core machine.
    return torch.from_numpy(np.concatenate([part.numpy() for part in parts]))


def _check_shapes(config: ModelConfig, w: ModelWeights) -> None:
    qkv_rows = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
    expected = {
        "embed": ((config.vocab_size, config.hidden_size), w.embed),
        "lm_head": ((config.vocab_size, config.hidden_size), w.lm_head),
        "qkv": ((qkv_rows, config.hidden_size), w.layers[0].qkv),
        "gate_up": ((2 * config.intermediate_size, config.hidden_size), w.layers[0].gate_up),
        "down": ((config.hidden_size, config.intermediate_size), w.layers[0].down),
    }
    for name, (shape, tensor) in expected.items():
        if tuple(tensor.shape) != shape:
            raise CheckpointError(f"{name} has shape {tuple(tensor.shape)}; the config implies {shape}")
