"""Attention of decode and verify queries over the paged KV cache, with no shape that moves.

B sequences bring T new tokens each. Query (b, t) sits at positions[b, t] and sees the keys of
its sequence's slot at positions 0..positions[b, t] (its own chunk's keys are written before
attention runs); the slot's block table says where each position sits in the pool (kv_cache.py).
How far each query reads is a value in a tensor, not a shape, so the same launch serves every
step: what CUDA graphs need.

The Triton kernel runs one program per (sequence, query token, head). It reads K and V in place
through the block table (no gather into a batch), loops over tiles of keys up to the query's
position with an online softmax in fp32, and the query heads that share a KV head (GQA) read the
same K/V rows. CUDA tensors run the kernel, CPU tensors the PyTorch reference; the tests
compare the two under TRITON_INTERPRET on CPU and compiled on CUDA.
"""
from __future__ import annotations

import os

import torch

from tandem.model.kv_cache import PAGE_SIZE

# Triton is imported only where it can launch (a GPU, or its interpreter), or where TANDEM_TRITON=1
# asks for its compiler (to compile the kernels for a GPU on a machine without one): on a CPU
# server it would cost 90 MB of resident memory and 0.3 s of start for nothing.
try:
    if not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
            or os.environ.get("TANDEM_TRITON") == "1"):
        raise ImportError("no GPU, no interpreter, and no TANDEM_TRITON=1")
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs run the reference and never launch the kernel
    triton = None
    tl = None

KERNEL_AVAILABLE = triton is not None
# The interpreter pays per loop iteration, a GPU for registers: fewer, larger blocks on CPU.
INTERPRETED = triton is not None and os.environ.get("TRITON_INTERPRET") == "1"
BLOCK_KEYS = 128 if INTERPRETED else 64


def kernel_supports(head_dim: int) -> bool:
    """Whether the Triton kernel can run heads of this size (it takes whole power-of-two rows)."""
    return KERNEL_AVAILABLE and head_dim & (head_dim - 1) == 0


def slot_attention(
    q: torch.Tensor,  # [B, T, heads, head_dim]
    k_cache: torch.Tensor,  # [kv_heads, pool positions, head_dim]
    v_cache: torch.Tensor,  # [kv_heads, pool positions, head_dim]
    block_tables: torch.Tensor,  # [slots, max_pages] int32
    slot_ids: torch.Tensor,  # [B] int64
    positions: torch.Tensor,  # [B, T] int64, each < max_pages * PAGE_SIZE
) -> torch.Tensor:
    """Returns [B, T, heads, head_dim], contiguous, in q's dtype. Positions and tables are not checked
    (that would sync)."""
    check_slot_attention_args(q, k_cache, v_cache, block_tables, slot_ids, positions)
    if q.is_cuda:
        return slot_attention_triton(q, k_cache, v_cache, block_tables, slot_ids, positions)
    return slot_attention_reference(q, k_cache, v_cache, block_tables, slot_ids, positions)


def check_slot_attention_args(q, k_cache, v_cache, block_tables, slot_ids, positions) -> None:
    """Shapes, dtypes, devices and layouts: metadata only, so it runs inside a CUDA graph capture."""
    batch, num_new, heads, head_dim = q.shape
    kv_heads, _, cache_dim = k_cache.shape
    problems = []
    if k_cache.shape != v_cache.shape or cache_dim != head_dim:
        problems.append(f"K/V caches {list(k_cache.shape)}, {list(v_cache.shape)} for head_dim {head_dim}")
    if heads % kv_heads:
        problems.append(f"{heads} query heads do not share {kv_heads} KV heads evenly")
    if head_dim & (head_dim - 1):
        problems.append(f"head_dim {head_dim} is not a power of two")
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        problems.append(f"dtypes q {q.dtype}, k {k_cache.dtype}, v {v_cache.dtype} differ")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        problems.append("the K/V caches must be contiguous")
    if q.stride(3) != 1:
        problems.append(f"q strides {q.stride()}: head_dim must be contiguous")
    if slot_ids.shape != (batch,) or positions.shape != (batch, num_new):
        problems.append(f"slot_ids {list(slot_ids.shape)} / positions {list(positions.shape)} "
                        f"for B={batch}, T={num_new}")
    index_tensors = (slot_ids, positions)
    if any(t.dtype != torch.int64 or not t.is_contiguous() for t in index_tensors):
        problems.append("slot_ids and positions must be contiguous int64")
    if block_tables.dim() != 2 or block_tables.dtype != torch.int32 or not block_tables.is_contiguous():
        problems.append(f"block_tables must be a contiguous int32 [slots, max_pages], not {block_tables.dtype} "
                        f"{list(block_tables.shape)}")
    if len({t.device for t in (q, k_cache, v_cache, block_tables, slot_ids, positions)}) != 1:
        problems.append("all tensors must be on one device")
    if problems:
        raise ValueError("slot_attention: " + "; ".join(problems))


def slot_attention_reference(q, k_cache, v_cache, block_tables, slot_ids, positions) -> torch.Tensor:
    """PyTorch reference of `slot_attention`: fp32 scores over whole slots, masked past each query."""
    batch, num_new, heads, head_dim = q.shape
    kv_heads = k_cache.shape[0]
    group = heads // kv_heads
    pages = block_tables.index_select(0, slot_ids).long()  # [B, max_pages]
    pool = (pages[:, :, None] * PAGE_SIZE + torch.arange(PAGE_SIZE, device=q.device)).flatten(1)  # [B, max_len]
    max_len = pool.shape[1]
    k = k_cache[:, pool].transpose(0, 1).float()  # [B, kv_heads, max_len, head_dim]
    v = v_cache[:, pool].transpose(0, 1).float()
    queries = q.float().view(batch, num_new, kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)  # [B, kv, G, T, D]
    scores = queries @ k.unsqueeze(2).transpose(-1, -2) / head_dim**0.5  # [B, kv_heads, G, T, max_len]
    visible = torch.arange(max_len, device=q.device) <= positions.unsqueeze(-1)  # [B, T, max_len]
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    out = scores.softmax(dim=-1) @ v.unsqueeze(2)  # [B, kv_heads, G, T, head_dim]
    return out.permute(0, 3, 1, 2, 4).reshape(batch, num_new, heads, head_dim).to(q.dtype).contiguous()


def slot_attention_triton(q, k_cache, v_cache, block_tables, slot_ids, positions) -> torch.Tensor:
    """Launch `_slot_attention_kernel`, one program per (query row, head)."""
    if not KERNEL_AVAILABLE:
        raise RuntimeError("triton is not installed: slot attention on CUDA needs it (pip install 'triton>=3.6')")
    batch, num_new, heads, head_dim = q.shape
    out = torch.empty(batch, num_new, heads, head_dim, dtype=q.dtype, device=q.device)
    grid = (batch * num_new, heads)
    _slot_attention_kernel[grid](
        out, q, k_cache, v_cache, block_tables, slot_ids, positions,
        num_new, heads // k_cache.shape[0], head_dim**-0.5,
        q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), block_tables.stride(0),
        HEAD_DIM=head_dim, BLOCK_N=BLOCK_KEYS, PAGE=PAGE_SIZE,
    )
    return out


def _jit(fn):
    return fn if triton is None else triton.jit(do_not_specialize=["num_new"])(fn)


@_jit
def _slot_attention_kernel(
    out_ptr, q_ptr, k_ptr, v_ptr, tables_ptr, slot_ids_ptr, positions_ptr,
    num_new, group, scale,
    q_batch_stride, q_token_stride, q_head_stride, cache_head_stride, table_stride,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
):
    """out[row, head] = softmax(q k^T * scale) v over keys 0..positions[row] of the row's slot."""
    row = tl.program_id(0)  # b * num_new + t
    head = tl.program_id(1)
    batch = row // num_new
    slot = tl.load(slot_ids_ptr + batch).to(tl.int64)
    last_key = tl.load(positions_ptr + row).to(tl.int32)
    dims = tl.arange(0, HEAD_DIM)
    q_offset = batch.to(tl.int64) * q_batch_stride + (row % num_new) * q_token_stride + head * q_head_stride
    q = tl.load(q_ptr + q_offset + dims).to(tl.float32) * scale
    head_offset = (head // group).to(tl.int64) * cache_head_stride
    k_rows = k_ptr + head_offset
    v_rows = v_ptr + head_offset
    table = tables_ptr + slot * table_stride
    running_max = tl.full((), float("-inf"), tl.float32)
    running_sum = tl.full((), 0.0, tl.float32)
    acc = tl.zeros((HEAD_DIM,), tl.float32)
    for start in range(0, last_key + 1, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        visible = keys <= last_key
        blocks = tl.load(table + keys // PAGE, mask=visible, other=0).to(tl.int64)  # [BLOCK_N]
        pool = blocks * PAGE + keys % PAGE
        offsets = pool[:, None] * HEAD_DIM + dims[None, :]  # [BLOCK_N, HEAD_DIM]
        k = tl.load(k_rows + offsets, mask=visible[:, None], other=0.0).to(tl.float32)
        scores = tl.where(visible, tl.sum(k * q[None, :], axis=1), float("-inf"))  # [BLOCK_N]
        new_max = tl.maximum(running_max, tl.max(scores, axis=0))
        # Key 0 is always visible, so new_max is finite from the first block on.
        rescale = tl.exp(running_max - new_max)
        weights = tl.exp(scores - new_max)
        v = tl.load(v_rows + offsets, mask=visible[:, None], other=0.0).to(tl.float32)
        running_sum = running_sum * rescale + tl.sum(weights, axis=0)
        acc = acc * rescale + tl.sum(weights[:, None] * v, axis=0)
        running_max = new_max
    num_heads = tl.num_programs(1)
    out_offset = (row.to(tl.int64) * num_heads + head) * HEAD_DIM + dims
    tl.store(out_ptr + out_offset, (acc / running_sum).to(out_ptr.dtype.element_ty))
