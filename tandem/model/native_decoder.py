"""A model's weights and KV cache bound to the native CPU decoder (csrc/decoder.c)."""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from gguf import GGMLQuantizationType

from tandem.config import ModelConfig
from tandem.model import native
from tandem.model.batch import SequenceChunk
from tandem.model.block_matrix import BLOCK_SIZE, BlockMatrix
from tandem.model.kv_cache import KVCache

if TYPE_CHECKING:
    from tandem.model.llama import Matrix, ModelWeights

KV_TYPES = {torch.float32: native.KV_F32, torch.bfloat16: native.KV_BF16, torch.float16: native.KV_F16}
BLOCK_ACTIVATIONS = ("int16", "int8")  # what a block matrix's inputs are quantized to (csrc/blocks.h)


@dataclass(frozen=True, slots=True)
class NativeBatch:
    """One forward's index arrays, as decoder.c's Batch reads them."""

    chunks: tuple[SequenceChunk, ...]
    token_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    chunk_slots: torch.Tensor  # [C] int32
    chunk_starts: torch.Tensor  # [C + 1] int32
    out_tokens: torch.Tensor  # [num_logits] int32: token indices whose logits come out

    @property
    def num_tokens(self) -> int:
        return self.token_ids.shape[0]

    @classmethod
    def build(cls, chunks: list[SequenceChunk]) -> "NativeBatch":
        ids: list[int] = []
        positions: list[int] = []
        starts = [0]
        out: list[int] = []
        for c in chunks:
            ids.extend(c.token_ids)
            positions.extend(range(c.start, c.end))
            out.extend(range(len(ids) - c.num_logits, len(ids)))
            starts.append(len(ids))
        return cls(tuple(chunks), torch.tensor(ids, dtype=torch.int64), torch.tensor(positions, dtype=torch.int64),
                   torch.tensor([c.slot for c in chunks], dtype=torch.int32), torch.tensor(starts, dtype=torch.int32),
                   torch.tensor(out, dtype=torch.int32))


def supports(config: ModelConfig, dtype: torch.dtype, device: torch.device, blocks: bool = False) -> bool:
    """Whether the native decoder can run this model here (else the PyTorch path does); blocks:
    with its matrices in GGUF blocks, whose inputs are quantized per head and per 32 columns."""
    width = BLOCK_SIZE if blocks else 2
    return (device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
            and config.head_dim % native.KEY_BLOCK == 0 and config.head_dim % width == 0
            and config.hidden_size % width == 0 and config.intermediate_size % width == 0
            and native.load() is not None)


def check_block_activations(name: str) -> None:
    if name not in BLOCK_ACTIVATIONS:
        raise ValueError(f"--block-activations must be one of {', '.join(BLOCK_ACTIVATIONS)}, got {name!r}")


def weights_kind(weights: ModelWeights, block_activations: str = "int16") -> int:
    """native.WEIGHTS_*: every matrix in blocks (their inputs quantized to block_activations, one of
    BLOCK_ACTIVATIONS), or every one a tensor of one float dtype."""
    check_block_activations(block_activations)
    blocks = [isinstance(m, BlockMatrix) for m in weights.matrices]
    if all(blocks):
        return native.WEIGHTS_BLOCKS_X8 if block_activations == "int8" else native.WEIGHTS_BLOCKS
    if any(blocks):
        raise ValueError("the native decoder takes matrices all in GGUF blocks or all in one float dtype")
    return native.WEIGHTS_BF16 if weights.embed.dtype == torch.bfloat16 else native.WEIGHTS_F32


class NativeDecoder:
    """Packs the weights into the library's panels and runs whole forward passes in C."""

    def __init__(self, config: ModelConfig, weights, kv_cache: KVCache, rope_cos: torch.Tensor,
                 rope_sin: torch.Tensor, library: native.Library, block_activations: str = "int16"):
        """weights: ModelWeights already in the compute dtype; rope tables [>= cache positions, head_dim / 2]."""
        self.library = library
        self.kind = weights_kind(weights, block_activations)
        self.block_types: set[GGMLQuantizationType] = set()  # of the matrices kept in blocks
        self.vocab_rows = weights.lm_head.shape[0]
        self._keep: list[object] = []  # every array and struct the C structs point at
        tied = weights.lm_head is weights.embed  # then the C code reads embeddings from the packed head
        self._lm_head = self._packed(weights.lm_head)
        layers = [self._layer(w, kv_cache.k[i], kv_cache.v[i]) for i, w in enumerate(weights.layers)]
        self._layers = (native.CLayer * len(layers))(*layers)
        self._model = native.CModel(
            hidden=config.hidden_size, intermediate=config.intermediate_size, num_layers=config.num_layers,
            num_heads=config.num_heads, num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
            max_len=kv_cache.positions, pool_positions=kv_cache.v[0].shape[1],
            block_tables=self._ptr(kv_cache.block_tables), weights_kind=self.kind,
            kv_type=KV_TYPES[kv_cache.dtype], eps=config.rms_norm_eps,
            rope_cos=self._ptr(rope_cos.float().contiguous()), rope_sin=self._ptr(rope_sin.float().contiguous()),
            embed=None if tied else self._embed(weights.embed),
            final_norm=self._ptr(weights.norm.float().contiguous()),
            lm_head=self._lm_head, layers=self._layers,
        )

    def forward(self, batch: NativeBatch, want_hidden: bool = False,
                capture_layers: tuple[int, ...] = ()) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """fp32 logits [num_logits, vocab rows], or the final normed hidden states [num_logits, hidden].

        capture_layers (ascending): also the residual stream entering each of these layers at every
        token, fp32 [T, len(capture_layers), hidden], returned second.
        """
        width = self._model.hidden if want_hidden else self._lm_head.panels * native.PANEL
        out = torch.empty(batch.out_tokens.shape[0], width, dtype=torch.float32)
        layers = torch.tensor(capture_layers, dtype=torch.int32)
        captured = torch.empty(batch.num_tokens, len(capture_layers), self._model.hidden, dtype=torch.float32)
        c_batch = native.CBatch(
            num_tokens=batch.num_tokens, token_ids=batch.token_ids.data_ptr(), positions=batch.positions.data_ptr(),
            num_chunks=batch.chunk_slots.shape[0], chunk_slots=batch.chunk_slots.data_ptr(),
            chunk_starts=batch.chunk_starts.data_ptr(), num_out=batch.out_tokens.shape[0],
            out_tokens=batch.out_tokens.data_ptr(), want_hidden=int(want_hidden), out=out.data_ptr(),
            num_capture=len(capture_layers), capture_layers=layers.data_ptr() if capture_layers else None,
            captured=captured.data_ptr() if capture_layers else None,
        )
        self.library.forward(self._model, c_batch)
        result = out if want_hidden else self._trim(out)
        return (result, captured) if capture_layers else result

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [rows, vocab rows] of normed hidden states [rows, hidden]."""
        x = hidden.to(torch.bfloat16 if self.kind == native.WEIGHTS_BF16 else torch.float32).contiguous()
        return self._trim(self.library.gemm(x, self._lm_head, self.kind))

    def _trim(self, padded: torch.Tensor) -> torch.Tensor:
        return padded if padded.shape[1] == self.vocab_rows else padded[:, : self.vocab_rows].contiguous()

    def _layer(self, w, k_cache: torch.Tensor, v_cache: torch.Tensor) -> native.CLayer:
        return native.CLayer(
            attn_norm=self._ptr(w.attn_norm.float().contiguous()), qkv=self._packed(w.qkv),
            qkv_bias=None if w.qkv_bias is None else self._ptr(w.qkv_bias.float().contiguous()),
            o=self._packed(w.o), mlp_norm=self._ptr(w.mlp_norm.float().contiguous()),
            gate_up=self._packed(w.gate_up), down=self._packed(w.down),
            k_cache=k_cache.data_ptr(), v_cache=v_cache.data_ptr(),
        )

    def _packed(self, weight: Matrix) -> native.PackedMatrix:
        if isinstance(weight, BlockMatrix):
            self.block_types |= {part.ggml_type for part in weight.parts}
            table, packed = weight.groups(self.library.group_rows)
            self._keep.extend((table, *packed))
            return native.block_matrix(table, *weight.shape)
        packed = native.pack(weight)
        self._keep.append(packed)
        return native.packed_matrix(packed, weight.shape[0])

    def _embed(self, embed: Matrix) -> int:
        """Rows of the embedding, in the weights' element type, or a table of block rows."""
        if isinstance(embed, BlockMatrix):
            matrix = self._packed(embed)
            self._keep.append(matrix)
            return ctypes.addressof(matrix)
        return self._ptr(embed.contiguous())

    def _ptr(self, tensor: torch.Tensor) -> int:
        self._keep.append(tensor)
        return tensor.data_ptr()
