"""HF checkpoint folders: config.json plus one or several (indexed) safetensors files."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from tandem.config import ModelConfig
from tandem.loaders.errors import CheckpointError
from tandem.loaders.assemble import assemble_weights
from tandem.model.llama import ModelWeights

_HF_NAMES = {
    "embed": "model.embed_tokens.weight",
    "norm": "model.norm.weight",
    "lm_head": "lm_head.weight",
    "attn_norm": "model.layers.{i}.input_layernorm.weight",
    "q": "model.layers.{i}.self_attn.q_proj.weight",
    "k": "model.layers.{i}.self_attn.k_proj.weight",
    "v": "model.layers.{i}.self_attn.v_proj.weight",
    "q_bias": "model.layers.{i}.self_attn.q_proj.bias",
    "k_bias": "model.layers.{i}.self_attn.k_proj.bias",
    "v_bias": "model.layers.{i}.self_attn.v_proj.bias",
    "o": "model.layers.{i}.self_attn.o_proj.weight",
    "mlp_norm": "model.layers.{i}.post_attention_layernorm.weight",
    "gate": "model.layers.{i}.mlp.gate_proj.weight",
    "up": "model.layers.{i}.mlp.up_proj.weight",
    "down": "model.layers.{i}.mlp.down_proj.weight",
}


def load_hf_folder(folder: Path) -> tuple[ModelConfig, ModelWeights]:
    config_path = folder / "config.json"
    if not config_path.exists():
        raise CheckpointError(f"{folder} has no config.json")
    config = ModelConfig.from_hf(json.loads(config_path.read_text()))
    files = tensor_files(folder)
    handles = {f: safe_open(str(f), framework="pt") for f in set(files.values())}

    def get(role: str, layer: int | None) -> torch.Tensor | None:
        name = _HF_NAMES[role].format(i=layer)
        file = files.get(name)
        return None if file is None else handles[file].get_tensor(name).float()

    return config, assemble_weights(config, get)


def tensor_files(folder: Path) -> dict[str, Path]:
    """Maps each tensor name to the safetensors file that holds it."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise CheckpointError(f"{folder} has no .safetensors files")
    files: dict[str, Path] = {}
    for shard in shards:
        with safe_open(str(shard), framework="pt") as handle:
            files.update({name: shard for name in handle.keys()})
    return files
