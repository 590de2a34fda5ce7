"""Small GGUF files for tokenizer tests: tokenizer metadata and just enough of a llama header."""
from __future__ import annotations

from pathlib import Path

import gguf


def write_tokenizer_gguf(path: Path, model: str, tokens: list[str], scores: list[float] | None = None,
                types: list[int] | None = None, pre: str | None = None, merges: list[str] | None = None) -> Path:
    """A GGUF with tokenizer metadata, and just enough llama hyperparameters for transformers to open it."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(model)
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    if scores is not None:
        writer.add_token_scores(scores)
    if types is not None:
        writer.add_token_types(types)
    if merges is not None:
        writer.add_token_merges(merges)
    for add in (writer.add_context_length, writer.add_embedding_length, writer.add_block_count,
                writer.add_feed_forward_length, writer.add_head_count, writer.add_head_count_kv):
        add(8)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_bos_token_id(1 if len(tokens) > 1 else 0)
    writer.add_eos_token_id(2 if len(tokens) > 2 else 0)
    writer.add_unk_token_id(0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
