"""Model configuration, read from an HF config.json or from GGUF metadata."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")
HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


class UnsupportedModelError(ValueError):
    """The checkpoint is not a Llama-family model this runtime implements."""


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Llama 3 frequency-dependent RoPE scaling."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    rope_scaling: RopeScaling | None = None

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"architecture {self.architecture!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )

    @property
    def queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        model_type = cfg.get("model_type", "")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} in config.json is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        num_heads = cfg["num_attention_heads"]
        # transformers 5 writes "rope_parameters" (theta inside); older versions "rope_scaling".
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        return cls(
            architecture=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta") or rope.get("rope_theta", 10000.0),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", model_type == "qwen2"),
            rope_scaling=_rope_scaling_from_hf(rope),
        )

    def to_hf(self) -> dict[str, Any]:
        """config.json's fields that from_hf reads, without rope scaling: what a gateway reads of the model."""
        return {"model_type": self.architecture, "architectures": [HF_ARCHITECTURES[self.architecture]],
                "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
                "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_layers,
                "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
                "head_dim": self.head_dim, "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
                "max_position_embeddings": self.max_position_embeddings,
                "tie_word_embeddings": self.tie_word_embeddings, "attention_bias": self.attention_bias}


def _rope_scaling_from_hf(scaling: dict[str, Any]) -> RopeScaling | None:
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return None
    if kind != "llama3":
        raise UnsupportedModelError(f"rope_scaling type {kind!r} is not supported; only 'llama3' is")
    return RopeScaling(
        factor=scaling["factor"],
        low_freq_factor=scaling["low_freq_factor"],
        high_freq_factor=scaling["high_freq_factor"],
        original_max_position_embeddings=scaling["original_max_position_embeddings"],
    )
