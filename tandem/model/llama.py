"""One Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2) written for serving."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from tandem.config import ModelConfig
from tandem.model import native
from tandem.model.block_matrix import BlockMatrix
from tandem.model.batch import SequenceChunk
from tandem.model.kv_cache import DEFAULT_BLOCK_SIZE, KVCache
from tandem.model.native_decoder import NativeBatch, NativeDecoder, supports as native_supports
from tandem.model.rope import RotaryEmbedding, rope_inv_freq
from tandem.model.slot_attention import kernel_supports
from tandem.model.torch_decoder import TorchDecoder

# auto: the native CPU decoder where it runs, else PyTorch; torch: always PyTorch (the reference).
Backend = Literal["auto", "torch", "native"]


# A weight matrix: a float tensor, or GGUF blocks as stored (the native CPU decoder multiplies those).
Matrix = torch.Tensor | BlockMatrix
_MATRICES = ("qkv", "o", "gate_up", "down")


@dataclass(slots=True)
class LayerWeights:
    attn_norm: torch.Tensor  # [hidden]
    qkv: Matrix  # [(heads + 2 * kv_heads) * head_dim, hidden]
    qkv_bias: torch.Tensor | None  # [(heads + 2 * kv_heads) * head_dim]
    o: Matrix  # [hidden, heads * head_dim]
    mlp_norm: torch.Tensor  # [hidden]
    gate_up: Matrix  # [2 * intermediate, hidden]
    down: Matrix  # [hidden, intermediate]


@dataclass(slots=True)
class ModelWeights:
    embed: Matrix  # [vocab, hidden]
    layers: list[LayerWeights]
    norm: torch.Tensor  # [hidden]
    lm_head: Matrix  # [vocab, hidden]; the embedding itself when tied
    rope_inv_freq: torch.Tensor | None = None  # set when the checkpoint stores its own frequencies

    @property
    def matrices(self) -> list[Matrix]:
        return [self.embed, self.lm_head, *(getattr(layer, f) for layer in self.layers for f in _MATRICES)]

    @property
    def in_blocks(self) -> bool:
        """Whether any matrix is kept in GGUF blocks."""
        return any(isinstance(m, BlockMatrix) for m in self.matrices)

    def to(self, dtype: torch.dtype, device: torch.device) -> "ModelWeights":
        """Float tensors converted; block matrices stay as stored."""
        def conv(t: Matrix | None) -> Matrix | None:
            if t is None or isinstance(t, BlockMatrix):
                return t
            return t.to(device=device, dtype=dtype).contiguous()

        return self._mapped(conv, conv)

    def map_matrices(self, fn: Callable[[Matrix], Matrix]) -> "ModelWeights":
        """The same weights with fn applied to every matrix (the embedding and head included)."""
        return self._mapped(fn, lambda t: t)

    def _mapped(self, matrix: Callable, other: Callable) -> "ModelWeights":
        def layer(w: LayerWeights) -> LayerWeights:
            return LayerWeights(*((matrix if f in _MATRICES else other)(getattr(w, f)) for f in LayerWeights.__slots__))

        tied = self.lm_head is self.embed
        embed = matrix(self.embed)
        return ModelWeights(embed=embed, layers=[layer(w) for w in self.layers], norm=other(self.norm),
                            lm_head=embed if tied else matrix(self.lm_head), rope_inv_freq=self.rope_inv_freq)


def dequantized(weights: ModelWeights) -> ModelWeights:
    """Every block matrix as an fp32 tensor."""
    return weights.map_matrices(lambda m: m.dequantize() if isinstance(m, BlockMatrix) else m)


class LlamaModel:
    """Runs mixed batches of prefill, decode and verify chunks against a paged KV cache.

    The work is done by the native CPU decoder (csrc/decoder.c) or by the PyTorch decoder, the
    reference and the CUDA path; `backend` in build_model chooses, and `cuda_graphs` whether the
    PyTorch decoder runs decode and verify steps as CUDA graphs.
    """

    def __init__(self, config: ModelConfig, kv_cache: KVCache, decoder: NativeDecoder | TorchDecoder,
                 device: torch.device, dtype: torch.dtype):
        self.config = config
        self.kv_cache = kv_cache
        self.decoder = decoder
        self.device = device
        self.dtype = dtype

    @property
    def max_len(self) -> int:
        return self.kv_cache.max_len

    @property
    def native(self) -> bool:
        return isinstance(self.decoder, NativeDecoder)

    def build_batch(self, chunks: list[SequenceChunk]):
        """The decoder's batch for these chunks (opaque to callers: pass it to forward), their KV
        blocks reserved (CacheFullError when the pool has too few)."""
        if not chunks or any(not c.token_ids for c in chunks):
            raise ValueError("a forward batch needs at least one chunk, and no empty chunk")
        for c in chunks:
            if not 1 <= c.num_logits <= len(c.token_ids):
                raise ValueError(f"num_logits={c.num_logits} must be in [1, {len(c.token_ids)}]")
            if c.end > self.max_len:
                raise ValueError(f"sequence would reach {c.end} tokens; the cache holds {self.max_len}")
        for c in chunks:
            self.kv_cache.reserve(c.slot, c.end)
        if self.native:
            return NativeBatch.build(chunks)
        return self.decoder.build_batch(chunks)

    @torch.inference_mode()
    def forward(self, batch) -> torch.Tensor:
        """Returns float32 logits [num_logits, head_rows] at the positions the chunks asked for.

        head_rows is the vocabulary, or a drafter's reduced draft vocabulary.
        """
        return self.decoder.forward(batch)

    @torch.inference_mode()
    def forward_capturing(self, batch, layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """forward's logits, and the residual stream entering each of `layers` (ascending) at every
        token of the batch: fp32 [num_tokens, len(layers), hidden], the features EAGLE-style drafters read."""
        if not layers or list(layers) != sorted(set(layers)) or not 0 <= layers[0] <= layers[-1] < self.config.num_layers:
            raise ValueError(f"capture layers {list(layers)} must be distinct, ascending and in "
                             f"[0, {self.config.num_layers})")
        return self.decoder.forward(batch, capture_layers=tuple(layers))

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [rows, head_rows] of normed hidden states [rows, hidden]."""
        return self.decoder.logits(hidden)

    def greedy_tokens(self, logits: torch.Tensor) -> list[int]:
        """The first argmax of each row of logits [rows, head_rows], as torch.argmax picks it."""
        if self.native and logits.dtype == torch.float32 and logits.stride(1) == 1:
            return self.decoder.library.argmax(logits)
        return logits.argmax(dim=1).tolist()

    @torch.inference_mode()
    def final_hidden(self, batch) -> torch.Tensor:
        """The normed last hidden state [num_logits, hidden] that the lm_head reads."""
        return self.decoder.forward(batch, want_hidden=True)

    def run(self, chunks: list[SequenceChunk]) -> torch.Tensor:
        return self.forward(self.build_batch(chunks))


def build_model(
    config: ModelConfig,
    weights: ModelWeights,
    *,
    dtype: torch.dtype,
    device: torch.device,
    num_slots: int,
    max_model_len: int,
    backend: Backend = "auto",
    cuda_graphs: bool | None = None,
    kv_cache_tokens: int | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    kv_cache_dtype: torch.dtype | None = None,
    block_activations: str = "int16",
) -> LlamaModel:
    """backend "native" insists on the native decoder (ValueError where it can't run).

    cuda_graphs: uniform decode and verify steps through the static-shape forward, captured as
    CUDA graphs (static_steps.py). None: on for CUDA where the Triton kernel runs. True on CPU runs
    the same static forward eagerly, with the PyTorch decoder: what the CPU tests check.

    kv_cache_tokens: the KV pool's size in tokens (whole blocks of block_size); None: num_slots x
    max_model_len.

    kv_cache_dtype: None: `dtype`, but fp16 for bf16 with GGUF blocks on the native decoder, as
    llama.cpp keeps it. A bf16 cache there parted from transformers' greedy text on 3 of the 12
    held-out prompts (AVX-512 build; 1 with AVX2) where fp16 and fp32 parted on none
    (docs/benchmarks.md); fp16 costs bf16's bytes.
    """
    device = torch.device(device)
    static_steps = cuda_graphs if cuda_graphs is not None else (
        device.type == "cuda" and kernel_supports(config.head_dim))
    if static_steps and backend == "native":
        raise ValueError("cuda_graphs runs the PyTorch decoder: ask for backend 'torch' or 'auto'")
    use_native = (backend != "torch" and not static_steps
                  and native_supports(config, dtype, device, blocks=weights.in_blocks))
    if backend == "native" and not use_native:
        raise ValueError(f"the native CPU decoder can't run this model on {device} in {dtype}")
    if weights.in_blocks and not use_native:  # only the native decoder multiplies blocks
        weights = dequantized(weights)
    weights = weights.to(dtype, device)
    if kv_cache_dtype is None:
        kv_cache_dtype = torch.float16 if use_native and weights.in_blocks and dtype == torch.bfloat16 else dtype
    if kv_cache_dtype != dtype and not use_native:
        raise ValueError(f"a {kv_cache_dtype} KV cache for {dtype} compute needs the native CPU decoder")
    cache = KVCache(config, num_slots=num_slots, max_len=max_model_len, dtype=kv_cache_dtype, device=device,
                    transposed_keys=use_native, spare_slot=static_steps, block_size=block_size,
                    num_blocks=None if kv_cache_tokens is None else -(-kv_cache_tokens // block_size))
    inv_freq = weights.rope_inv_freq if weights.rope_inv_freq is not None else rope_inv_freq(config)
    if use_native:
        rope = RotaryEmbedding(inv_freq, cache.positions, torch.float32, device)
        decoder = NativeDecoder(config, weights, cache, rope.cos, rope.sin, native.load(), block_activations)
    else:
        rope = RotaryEmbedding(inv_freq, max_model_len, dtype, device)
        decoder = TorchDecoder(config, weights, cache, rope, static_steps=static_steps)
    return LlamaModel(config, cache, decoder, device, dtype)
