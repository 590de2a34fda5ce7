"""Loading a model for serving: checkpoint, tokenizer and KV cache, by name or path."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.config import ModelConfig
from tandem.loaders import CheckpointError, load_checkpoint
from tandem.model.llama import LlamaModel, build_model
from tandem.registry import resolve_model_path
from tandem.tokenizer import Tokenizer

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


@dataclass(slots=True)
class LoadedModel:
    name: str
    path: Path
    config: ModelConfig
    model: LlamaModel
    tokenizer: Tokenizer


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """fp32 by default on CPU, bf16 on CUDA."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of: auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def load_tokenizer(path: Path) -> Tokenizer:
    return Tokenizer.from_dir(path) if path.is_dir() else Tokenizer.from_gguf(path)


def load_model(
    name_or_path: str,
    *,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device = "cpu",
    num_slots: int = 8,
    max_model_len: int = 2048,
) -> LoadedModel:
    path = resolve_model_path(name_or_path)
    device = torch.device(device)
    config, weights = load_checkpoint(path)
    tokenizer = load_tokenizer(path)
    check_vocabulary(config, tokenizer)
    model = build_model(config, weights, dtype=resolve_dtype(dtype, device), device=device,
                        num_slots=num_slots, max_model_len=max_model_len)
    return LoadedModel(name=name_or_path, path=path, config=config, model=model, tokenizer=tokenizer)


def check_vocabulary(config: ModelConfig, tokenizer: Tokenizer) -> None:
    if tokenizer.vocab_size > config.vocab_size:
        raise CheckpointError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but the model's embedding has "
            f"{config.vocab_size} rows: they do not belong together"
        )
