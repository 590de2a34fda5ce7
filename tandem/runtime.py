"""Loading a model for serving: checkpoint, tokenizer and KV cache, by name or path."""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.config import ModelConfig
from tandem.loaders import CheckpointError, load_checkpoint
from tandem.loaders.drafter_file import weights_fingerprint
from tandem.loaders.drafter_file import assemble_drafter, drafter_target as recorded_target, is_drafter_file, read_drafter_file
from tandem.loaders.eagle3 import is_eagle3_folder, load_eagle3
from tandem.model import native
from tandem.model.eagle3 import Eagle3Model
from tandem.model.kv_cache import DEFAULT_BLOCK_SIZE, KV_CACHE_DTYPES
from tandem.model.llama import LlamaModel, build_model
from tandem.quantization import check_block_activations, keeps_blocks, quantize
from tandem.registry import resolve_model_path
from tandem.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# --dtype: the KV cache's names, and their short forms
_DTYPES = {**{name: dtype for name, dtype in KV_CACHE_DTYPES.items() if dtype is not None},
           "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(slots=True)
class LoadedModel:
    name: str
    path: Path
    config: ModelConfig
    model: LlamaModel
    tokenizer: Tokenizer
    draft_vocab: torch.Tensor | None = None  # [N] target ids of a drafter's head rows; None: every id


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """auto: bf16 on CUDA, and on CPUs the native decoder runs on; fp32 on other CPUs.

    bf16 streams half the bytes, which is what a decode step costs: on this project's CPU it decodes
    SmolLM2-135M twice as fast as fp32 (README, Speed on CPU). Greedy output then follows the bf16
    model, which parts from the fp32 one on some prompts; --dtype float32 gives the fp32 model.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" or native.load() is not None else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of: auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def dtype_name(dtype: torch.dtype) -> str:
    """The name --dtype and --kv-cache-dtype take, and metrics and vLLM's GetServerInfo report."""
    return str(dtype).removeprefix("torch.")


def check_kv_cache_dtype(name: str, dtype: str, device: str) -> None:
    """--kv-cache-dtype at startup, before a model loads: a known name, and on CUDA (the PyTorch
    decoder, whose cache is in the compute dtype) auto or the compute dtype itself."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")
    target = torch.device(device)
    if name != "auto" and target.type == "cuda" and KV_CACHE_DTYPES[name] != resolve_dtype(dtype, target):
        raise ValueError(f"--kv-cache-dtype {name} on {device} needs --dtype {name}: only the native "
                         f"CPU decoder keeps its KV cache in another type than it computes in")


def load_tokenizer(path: Path) -> Tokenizer:
    return Tokenizer.from_dir(path) if path.is_dir() else Tokenizer.from_gguf(path)


def load_model(
    name_or_path: str,
    *,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device = "cpu",
    num_slots: int = 8,
    max_model_len: int = 2048,
    drafter_target: str = "",
    kv_cache_tokens: int | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    quantization: str = "auto",
    kv_cache_dtype: str = "auto",
    block_activations: str = "int16",
) -> LoadedModel:
    """A checkpoint, or a distilled drafter file on its target (`drafter_target`, else the one it names).

    kv_cache_tokens: the KV pool's size; None: num_slots x max_model_len. block_size: positions per
    KV block. quantization: one of QUANTIZATIONS (tandem/quantization.py). kv_cache_dtype: a key of
    KV_CACHE_DTYPES (tandem/model/kv_cache.py). block_activations: one of BLOCK_ACTIVATIONS."""
    check_block_activations(block_activations)
    path = resolve_model_path(name_or_path)
    device = torch.device(device)
    keep_blocks = keeps_blocks(quantization, device)
    draft_vocab = None
    if is_drafter_file(path):
        drafter = read_drafter_file(path)
        path = resolve_model_path(drafter_target or drafter.target)
        config, weights = assemble_drafter(drafter, *load_checkpoint(path))
        draft_vocab = drafter.draft_vocab.to(device)
        if dtype in (None, "auto"):
            # Its layers are stored in bf16; bf16 compute also halves the bytes each draft token reads.
            dtype = torch.bfloat16
    else:
        config, weights = load_checkpoint(path, keep_blocks)
    tokenizer = load_tokenizer(path)
    check_vocabulary(config, tokenizer)
    dtype = resolve_dtype(dtype, device)
    weights = quantize(weights, quantization, config, dtype, device)
    model = build_model(config, weights, dtype=dtype, device=device,
                        num_slots=num_slots, max_model_len=max_model_len, kv_cache_tokens=kv_cache_tokens,
                        block_size=block_size, kv_cache_dtype=KV_CACHE_DTYPES[kv_cache_dtype],
                        block_activations=block_activations)
    if block_activations == "int8" and getattr(model.decoder, "kind", None) != native.WEIGHTS_BLOCKS_X8:
        log.warning("--block-activations int8 applies to GGUF block weights on the native CPU decoder; %s runs "
                    "without them (--quantization %s on %s)", name_or_path, quantization, device)
    return LoadedModel(name=name_or_path, path=path, config=config, model=model, tokenizer=tokenizer,
                       draft_vocab=draft_vocab)


@dataclass(slots=True)
class LoadedHead:
    """An EAGLE-3 draft head on its target's tokenizer (and embedding, where the head has none)."""

    path: Path
    target_path: Path
    model: Eagle3Model
    tokenizer: Tokenizer


def load_eagle3_head(folder: str, target: str, *, dtype: str | torch.dtype | None = None,
                     device: str | torch.device = "cpu", num_slots: int = 8, max_model_len: int = 2048) -> LoadedHead:
    """An EAGLE-3 head folder for the target checkpoint it drafts for (required: the head reads its
    features, and may share its embedding). auto dtype: bf16 on CUDA, fp32 on CPU (PyTorch runs the head)."""
    if not target:
        raise CheckpointError("an EAGLE-3 head needs its target checkpoint: pass --drafter-target")
    path, target_path = resolve_model_path(folder), resolve_model_path(target)
    if not is_eagle3_folder(path):
        raise CheckpointError(f"{path} is not an EAGLE-3 head folder (config.json with draft_vocab_size)")
    target_config, target_weights = load_checkpoint(target_path)
    trained_for = json.loads((path / "config.json").read_text()).get("tandem", {}).get("target_fingerprint")
    if trained_for and trained_for != weights_fingerprint(target_weights):
        raise CheckpointError(f"this EAGLE-3 head was trained by distill for another target (embedding "
                              f"fingerprint {trained_for[:16]}...): pass the target it was trained for")
    config, weights = load_eagle3(path, target_config, target_weights)
    device = torch.device(device)
    if dtype in (None, "auto"):
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = Eagle3Model(config, weights, dtype=resolve_dtype(dtype, device), device=device, num_slots=num_slots,
                        max_model_len=max_model_len)
    return LoadedHead(path, target_path, model, load_tokenizer(target_path))


def tokenizer_path(name_or_path: str, drafter_target: str = "") -> Path:
    """The checkpoint whose tokenizer a model uses: a drafter file's is its target's."""
    path = resolve_model_path(name_or_path)
    if is_drafter_file(path):
        return resolve_model_path(drafter_target or recorded_target(path))
    return path


def check_vocabulary(config: ModelConfig, tokenizer: Tokenizer) -> None:
    if tokenizer.vocab_size > config.vocab_size:
        raise CheckpointError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but the model's embedding has "
            f"{config.vocab_size} rows: they do not belong together"
        )
