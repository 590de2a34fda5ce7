"""Random EAGLE-3 heads written in the published layout (the tensor names vLLM and SGLang load)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from tandem.config import ModelConfig
from tandem.model.eagle3 import default_feature_layers


def write_eagle3_head(folder: Path, target: ModelConfig, layers: list[int] | None, draft_ids: list[int], *,
                      seed: int = 5, with_embedding: bool = False, scale: float = 0.3,
                      skip: tuple[str, ...] = ()) -> Path:
    """A head for `target` over draft_ids, its layer shaped like the target's layers. layers None: the
    config names none (EAGLE-3's default applies). skip: tensor names left out, to test the checks."""
    g = torch.Generator().manual_seed(seed)
    h, inter, hd = target.hidden_size, target.intermediate_size, target.head_dim
    q_rows, kv_rows = target.num_heads * hd, target.num_kv_heads * hd
    num_layers = len(default_feature_layers(target.num_layers) if layers is None else layers)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    ids = torch.tensor(draft_ids)
    tensors = {
        "fc.weight": rand(h, num_layers * h) / num_layers,
        "midlayer.input_layernorm.weight": 1 + rand(h) * 0.1,
        "midlayer.hidden_norm.weight": 1 + rand(h) * 0.1,
        "midlayer.self_attn.q_proj.weight": rand(q_rows, 2 * h),
        "midlayer.self_attn.k_proj.weight": rand(kv_rows, 2 * h),
        "midlayer.self_attn.v_proj.weight": rand(kv_rows, 2 * h),
        "midlayer.self_attn.o_proj.weight": rand(h, q_rows),
        "midlayer.post_attention_layernorm.weight": 1 + rand(h) * 0.1,
        "midlayer.mlp.gate_proj.weight": rand(inter, h),
        "midlayer.mlp.up_proj.weight": rand(inter, h),
        "midlayer.mlp.down_proj.weight": rand(h, inter),
        "norm.weight": 1 + rand(h) * 0.1,
        "lm_head.weight": rand(len(draft_ids), h) * 4,
        "d2t": ids - torch.arange(len(draft_ids)),
        "t2d": torch.isin(torch.arange(target.vocab_size), ids),
    }
    if with_embedding:
        tensors["embed_tokens.weight"] = rand(target.vocab_size, h)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v for k, v in tensors.items() if k not in skip}, str(folder / "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": h,
        "intermediate_size": inter, "num_attention_heads": target.num_heads,
        "num_key_value_heads": target.num_kv_heads, "head_dim": hd, "num_hidden_layers": 1,
        "rms_norm_eps": target.rms_norm_eps, "rope_theta": target.rope_theta, "max_position_embeddings": 2048,
        "vocab_size": target.vocab_size, "draft_vocab_size": len(draft_ids), "tie_word_embeddings": False,
    }
    if layers is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": layers}
    (folder / "config.json").write_text(json.dumps(config))
    return folder
