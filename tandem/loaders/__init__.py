"""Checkpoint loaders: HF folders (config.json + safetensors) and GGUF files."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from tandem.config import ModelConfig
from tandem.loaders.errors import CheckpointError

if TYPE_CHECKING:  # the loaders import torch; the tokenizer reads GGUF headers without it
    from tandem.model.llama import ModelWeights

__all__ = ["CheckpointError", "load_checkpoint"]


def load_checkpoint(path: Path, keep_blocks: bool = False) -> tuple[ModelConfig, ModelWeights]:
    """Reads config and float32 CPU weights from a .gguf file or an HF checkpoint folder; keep_blocks:
    a GGUF's block-quantized matrices stay in their blocks."""
    if path.is_dir():
        from tandem.loaders.hf import load_hf_folder

        return load_hf_folder(path)
    if path.suffix == ".gguf":
        from tandem.loaders.gguf_file import load_gguf

        return load_gguf(path, keep_blocks)
    raise CheckpointError(f"{path} is neither a checkpoint folder nor a .gguf file")
