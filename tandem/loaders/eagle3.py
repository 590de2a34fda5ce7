"""EAGLE-3 draft heads in the layout vLLM and SGLang load: config.json plus safetensors.

The tensors: `fc.weight`, the decoder layer under `midlayer.` (input_layernorm, hidden_norm,
self_attn.{q,k,v,o}_proj, post_attention_layernorm, mlp.{gate,up,down}_proj), `norm.weight`,
`lm_head.weight` over the draft vocabulary, and `d2t`, each head row's offset to its target id
(target id = row + d2t[row]). `embed_tokens.weight` is optional: without it the head uses the
target's embedding. A leading `model.` on the names is accepted. The target layers it reads come
from config.json's `eagle_config.eagle_aux_hidden_state_layer_ids`, else EAGLE-3's default
(layers 2, L / 2 and L - 3 of an L-layer target).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tandem.config import ModelConfig
from tandem.loaders.errors import CheckpointError
from tandem.loaders.hf import tensor_files
from tandem.model.eagle3 import Eagle3Config, Eagle3Weights, default_feature_layers
from tandem.model.llama import ModelWeights

ARCHITECTURE = "LlamaForCausalLMEagle3"
_LAYER = "midlayer."


def is_eagle3_folder(path: Path) -> bool:
    config = path / "config.json"
    if not (path.is_dir() and config.exists()):
        return False
    cfg = json.loads(config.read_text())
    return "draft_vocab_size" in cfg or any("eagle3" in a.lower() for a in cfg.get("architectures", []))


def load_eagle3(folder: Path, target_config: ModelConfig, target_weights: ModelWeights
                ) -> tuple[Eagle3Config, Eagle3Weights]:
    """The head at folder, for this target (its embedding where the head has none); float32 CPU weights."""
    cfg = json.loads((folder / "config.json").read_text())
    config = _config(cfg, target_config)
    tensors = _read_tensors(folder)

    def get(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in tensors:
            raise CheckpointError(f"{folder}: the EAGLE-3 head has no tensor {name!r}")
        tensor = tensors[name]
        if tuple(tensor.shape) != shape:
            raise CheckpointError(f"{folder}: {name} has shape {tuple(tensor.shape)}, expected {shape}")
        return tensor.float() if tensor.is_floating_point() else tensor

    layer = config.layer
    h, inter = layer.hidden_size, layer.intermediate_size
    q_rows, kv_rows = layer.num_heads * layer.head_dim, layer.num_kv_heads * layer.head_dim
    attn = {p: get(f"{_LAYER}self_attn.{p}_proj.weight", (rows, 2 * h))
            for p, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows))}
    embed = tensors.get("embed_tokens.weight")
    if embed is None:
        if target_config.hidden_size != h:
            raise CheckpointError(f"{folder}: no embed_tokens, and the target's embedding is {target_config.hidden_size} "
                                  f"wide, not the head's {h}")
        embed = target_weights.embed
    draft_vocab = config.draft_vocab_size
    d2t = get("d2t", (draft_vocab,)).long()
    draft_ids = torch.arange(draft_vocab) + d2t
    if int(draft_ids.min()) < 0 or int(draft_ids.max()) >= target_config.vocab_size:
        raise CheckpointError(f"{folder}: d2t maps head rows outside the target's vocabulary of "
                              f"{target_config.vocab_size}")
    weights = Eagle3Weights(
        fc=get("fc.weight", (h, len(config.feature_layers) * config.target_hidden_size)),
        embed=embed.float(),
        input_norm=get(f"{_LAYER}input_layernorm.weight", (h,)),
        hidden_norm=get(f"{_LAYER}hidden_norm.weight", (h,)),
        qkv=torch.cat([attn["q"], attn["k"], attn["v"]]),
        o=get(f"{_LAYER}self_attn.o_proj.weight", (h, q_rows)),
        post_norm=get(f"{_LAYER}post_attention_layernorm.weight", (h,)),
        gate_up=torch.cat([get(f"{_LAYER}mlp.gate_proj.weight", (inter, h)),
                           get(f"{_LAYER}mlp.up_proj.weight", (inter, h))]),
        down=get(f"{_LAYER}mlp.down_proj.weight", (h, inter)),
        norm=get("norm.weight", (h,)),
        lm_head=get("lm_head.weight", (draft_vocab, h)),
        draft_ids=draft_ids,
    )
    return config, weights


def save_eagle3(folder: Path, config: Eagle3Config, weights: Eagle3Weights, *, with_embedding: bool = False,
                extra_config: dict | None = None, dtype: torch.dtype = torch.float32) -> None:
    """Writes the head in the layout load_eagle3 (and vLLM, SGLang) read; float tensors in dtype."""
    layer = config.layer
    q_rows, kv_rows = layer.num_heads * layer.head_dim, layer.num_kv_heads * layer.head_dim
    q, k, v = weights.qkv.split([q_rows, kv_rows, kv_rows])
    gate, up = weights.gate_up.chunk(2)
    tensors = {
        "fc.weight": weights.fc, "norm.weight": weights.norm, "lm_head.weight": weights.lm_head,
        "d2t": weights.draft_ids - torch.arange(len(weights.draft_ids)),
        "t2d": _target_to_draft(weights.draft_ids, layer.vocab_size),
        f"{_LAYER}input_layernorm.weight": weights.input_norm, f"{_LAYER}hidden_norm.weight": weights.hidden_norm,
        f"{_LAYER}self_attn.q_proj.weight": q, f"{_LAYER}self_attn.k_proj.weight": k,
        f"{_LAYER}self_attn.v_proj.weight": v, f"{_LAYER}self_attn.o_proj.weight": weights.o,
        f"{_LAYER}post_attention_layernorm.weight": weights.post_norm,
        f"{_LAYER}mlp.gate_proj.weight": gate, f"{_LAYER}mlp.up_proj.weight": up,
        f"{_LAYER}mlp.down_proj.weight": weights.down,
    }
    if with_embedding:
        tensors["embed_tokens.weight"] = weights.embed
    folder.mkdir(parents=True, exist_ok=True)
    stored = {name: (t.to(dtype) if t.is_floating_point() else t).detach().contiguous().cpu()
              for name, t in tensors.items()}
    save_file(stored, str(folder / "model.safetensors"))
    cfg = {
        "architectures": [ARCHITECTURE], "model_type": "llama", "hidden_size": layer.hidden_size,
        "intermediate_size": layer.intermediate_size, "num_attention_heads": layer.num_heads,
        "num_key_value_heads": layer.num_kv_heads, "head_dim": layer.head_dim, "num_hidden_layers": 1,
        "rms_norm_eps": layer.rms_norm_eps, "rope_theta": layer.rope_theta,
        "max_position_embeddings": layer.max_position_embeddings, "vocab_size": layer.vocab_size,
        "draft_vocab_size": len(weights.draft_ids), "target_hidden_size": config.target_hidden_size,
        "tie_word_embeddings": False, "torch_dtype": str(dtype).removeprefix("torch."),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(config.feature_layers)},
        **(extra_config or {}),
    }
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))


def _config(cfg: dict, target: ModelConfig) -> Eagle3Config:
    try:
        layer = ModelConfig.from_hf({**cfg, "model_type": "llama", "num_hidden_layers": 1,
                                     "vocab_size": cfg.get("vocab_size", target.vocab_size)})
        draft_vocab = int(cfg.get("draft_vocab_size") or layer.vocab_size)
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"the EAGLE-3 config.json is incomplete or wrong: {err}") from None
    if layer.vocab_size != target.vocab_size:
        raise CheckpointError(f"the EAGLE-3 head drafts for a vocabulary of {layer.vocab_size}; the target has "
                              f"{target.vocab_size}")
    layers = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    layers = tuple(sorted(layers)) if layers else default_feature_layers(target.num_layers)
    if layers[-1] >= target.num_layers or layers[0] < 0:
        raise CheckpointError(f"the head reads target layers {list(layers)}; the target has {target.num_layers}")
    target_hidden = int(cfg.get("target_hidden_size") or target.hidden_size)
    if target_hidden != target.hidden_size:
        raise CheckpointError(f"the head reads features {target_hidden} wide; the target's are {target.hidden_size}")
    layer = dataclasses.replace(layer, max_position_embeddings=max(layer.max_position_embeddings,
                                                                   target.max_position_embeddings))
    return Eagle3Config(layer, target_hidden, layers, draft_vocab)


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in set(tensor_files(folder).values()):
        with safe_open(str(file), framework="pt") as handle:
            tensors.update((name.removeprefix("model."), handle.get_tensor(name)) for name in handle.keys())
    return tensors


def _target_to_draft(draft_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """t2d: which target ids the head can draft, as the published heads store it."""
    mask = torch.zeros(vocab_size, dtype=torch.bool)
    mask[draft_ids] = True
    return mask
