"""A distilled drafter file: only what the drafter adds to its target, in safetensors.

The file holds the student's decoder layers, its final norm and the draft vocabulary (the
target token ids its head can emit). The embedding and the head rows are the target's own, so
at load time they come from the target checkpoint, whose fingerprint must match the one that
the drafter was trained against.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tandem.config import ModelConfig
from tandem.loaders.errors import CheckpointError
from tandem.model.llama import LayerWeights, ModelWeights

FORMAT = "tandem-drafter/1"
SUFFIX = ".safetensors"
_LAYER_FIELDS = ("attn_norm", "qkv", "o", "mlp_norm", "gate_up", "down")


@dataclass(slots=True)
class DrafterFile:
    layers: list[LayerWeights]
    norm: torch.Tensor  # [hidden]
    draft_vocab: torch.Tensor  # [N] int64: target ids, in head-row order
    target: str  # the target model's name (registry) as trained
    target_fingerprint: str
    training: dict[str, Any]  # how it was trained: flags and held-out figures, for the README and Info


def weights_fingerprint(weights: ModelWeights) -> str:
    """sha256 over the float32 embedding and lm_head: what a drafter borrows from its target."""
    digest = hashlib.sha256()
    tensors = [weights.embed] if weights.lm_head is weights.embed else [weights.embed, weights.lm_head]
    for tensor in tensors:
        digest.update(tensor.float().contiguous().numpy().tobytes())
    return digest.hexdigest()


def is_drafter_file(path: Path) -> bool:
    if path.suffix != SUFFIX or not path.is_file():
        return False
    return _metadata(path).get("format") == FORMAT


def drafter_target(path: Path) -> str:
    """The target name recorded in a drafter file, read without loading its tensors."""
    return _metadata(path).get("target", "")


def _metadata(path: Path) -> dict[str, str]:
    with safe_open(str(path), framework="pt") as f:
        return f.metadata() or {}


def save_drafter_file(path: Path, drafter: DrafterFile, dtype: torch.dtype = torch.bfloat16) -> None:
    """Layers and norm stored in dtype (bf16 halves the file); the vocabulary as int32."""
    tensors = {"norm": drafter.norm, "draft_vocab": drafter.draft_vocab.to(torch.int32)}
    for i, layer in enumerate(drafter.layers):
        if layer.qkv_bias is not None:
            tensors[f"layers.{i}.qkv_bias"] = layer.qkv_bias
        for name in _LAYER_FIELDS:
            tensors[f"layers.{i}.{name}"] = getattr(layer, name)
    tensors = {k: (v if k == "draft_vocab" else v.to(dtype)).contiguous() for k, v in tensors.items()}
    metadata = {
        "format": FORMAT,
        "num_layers": str(len(drafter.layers)),
        "target": drafter.target,
        "target_fingerprint": drafter.target_fingerprint,
        "training": json.dumps(drafter.training, sort_keys=True),
    }
    save_file(tensors, str(path), metadata=metadata)


def read_drafter_file(path: Path) -> DrafterFile:
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
        if metadata.get("format") != FORMAT:
            raise CheckpointError(f"{path} is not a Tandem drafter file (format {metadata.get('format')!r})")
        names = set(f.keys())

        def get(name: str) -> torch.Tensor:
            if name not in names:
                raise CheckpointError(f"drafter file {path} has no tensor {name!r}")
            return f.get_tensor(name)

        num_layers = int(metadata["num_layers"])
        layers = [
            LayerWeights(
                **{name: get(f"layers.{i}.{name}").float() for name in _LAYER_FIELDS},
                qkv_bias=get(f"layers.{i}.qkv_bias").float() if f"layers.{i}.qkv_bias" in names else None,
            )
            for i in range(num_layers)
        ]
        return DrafterFile(
            layers=layers,
            norm=get("norm").float(),
            draft_vocab=get("draft_vocab").long(),
            target=metadata.get("target", ""),
            target_fingerprint=metadata.get("target_fingerprint", ""),
            training=json.loads(metadata.get("training", "{}")),
        )


def assemble_drafter(drafter: DrafterFile, target_config: ModelConfig,
                     target_weights: ModelWeights) -> tuple[ModelConfig, ModelWeights]:
    """The drafter as a model: its layers on the target's embedding, its head the target's draft-vocab rows."""
    fingerprint = weights_fingerprint(target_weights)
    if fingerprint != drafter.target_fingerprint:
        raise CheckpointError(
            f"this drafter was trained for a target whose embedding has fingerprint "
            f"{drafter.target_fingerprint[:16]}..., but the target given has {fingerprint[:16]}...: "
            f"pass the target it was trained for ({drafter.target or 'see its metadata'})"
        )
    vocab = drafter.draft_vocab
    if vocab.numel() == 0 or int(vocab.min()) < 0 or int(vocab.max()) >= target_config.vocab_size:
        raise CheckpointError(f"the draft vocabulary holds ids outside the target's [0, {target_config.vocab_size})")
    config = dataclasses.replace(target_config, num_layers=len(drafter.layers))
    weights = ModelWeights(
        embed=target_weights.embed,
        layers=drafter.layers,
        norm=drafter.norm,
        lm_head=target_weights.lm_head[vocab].contiguous(),  # [N, hidden]
        rope_inv_freq=target_weights.rope_inv_freq,
    )
    return config, weights
