"""The slot attention kernel equals its PyTorch reference, and the reference equals plain attention.

Without CUDA the kernel runs in Triton's interpreter on CPU tensors (conftest sets TRITON_INTERPRET);
the `gpu` variants run it compiled, through the public wrapper.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")

from tandem.model.kv_cache import PAGE_SIZE
from tandem.model.slot_attention import (
    INTERPRETED,
    slot_attention,
    slot_attention_reference,
    slot_attention_triton,
)
from tests.support.devices import triton_devices

DEVICES = triton_devices(INTERPRETED)
TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}


def _inputs(batch: int, num_new: int, kv_heads: int, group: int, head_dim: int, dtype: torch.dtype,
            last_positions: list[int], max_blocks: int = 13, num_slots: int = 6, seed: int = 0):
    """Queries [B, T, heads, head_dim] ending at last_positions, over slots in a shuffled order whose
    block tables are a shuffle of the pool's blocks."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, num_new, kv_heads * group, head_dim, generator=gen).to(dtype)
    pool = num_slots * max_blocks * PAGE_SIZE
    k_cache = torch.randn(kv_heads, pool, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(kv_heads, pool, head_dim, generator=gen).to(dtype)
    tables = torch.randperm(num_slots * max_blocks, generator=gen).view(num_slots, max_blocks).int()
    slot_ids = torch.randperm(num_slots, generator=gen)[:batch]
    positions = torch.tensor(last_positions)[:, None] - num_new + 1 + torch.arange(num_new)  # [B, T]
    return q, k_cache, v_cache, tables, slot_ids, positions


def _slot_keys(cache: torch.Tensor, tables: torch.Tensor, slot: int, length: int) -> torch.Tensor:
    """A slot's positions [0, length) of a [kv_heads, pool positions, head_dim] cache, read one by one."""
    pool = [tables[slot, p // PAGE_SIZE].item() * PAGE_SIZE + p % PAGE_SIZE for p in range(length)]
    return cache[:, pool]


def _launch(device: str, *args) -> torch.Tensor:
    """The kernel launcher on CPU tensors (interpreter), the public wrapper on CUDA tensors."""
    if device == "cpu":
        return slot_attention_triton(*args)
    return slot_attention(*(a.cuda() for a in args)).cpu()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("num_new", [1, 5])
def test_kernel_equals_reference_at_ragged_positions(device, dtype, head_dim, group, num_new):
    # Positions straddle key-block edges (63/64, 127/128) and include a query at position 0.
    last = [num_new - 1, 63 + num_new, 130, 199]
    args = _inputs(4, num_new, kv_heads=2, group=group, head_dim=head_dim, dtype=dtype, last_positions=last)
    expected = slot_attention_reference(*args)
    torch.testing.assert_close(_launch(device, *args), expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_new", [1, 5])
def test_kernel_reads_queries_through_strides(device, num_new):
    """The decoder hands q as a view into its fused QKV projection: rows wider than heads * head_dim
    (and with T = 1, a token stride that view() chose freely)."""
    q, k_cache, v_cache, tables, slot_ids, positions = _inputs(2, num_new, 2, 4, 64, torch.float32, [20, 77])
    expected = slot_attention_reference(q, k_cache, v_cache, tables, slot_ids, positions)
    fused = torch.cat([q.view(2 * num_new, 8, 64), torch.randn(2 * num_new, 4, 64)], dim=1)  # [B*T, 12, 64]
    view = fused.to(device)[:, :8].view(2, num_new, 8, 64)  # sliced on the device: .cuda() would compact it
    assert not view.is_contiguous()
    launch = slot_attention_triton if device == "cpu" else slot_attention
    got = launch(view, *(t.to(device) for t in (k_cache, v_cache, tables, slot_ids, positions)))
    torch.testing.assert_close(got.cpu(), expected, **TOLERANCE[torch.float32])


@pytest.mark.parametrize("group", [1, 3])
def test_reference_equals_sdpa_on_each_slot_prefix(group):
    """Query (b, t) attends to keys 0..positions[b, t] of slot slot_ids[b], found through its block
    table, and nothing else."""
    last = [4, 40, 199]
    q, k_cache, v_cache, tables, slot_ids, positions = _inputs(3, 5, 2, group, 64, torch.float32, last)
    got = slot_attention_reference(q, k_cache, v_cache, tables, slot_ids, positions)
    for b, slot in enumerate(slot_ids.tolist()):
        for t, position in enumerate(positions[b].tolist()):
            keys = _slot_keys(k_cache, tables, slot, position + 1).repeat_interleave(group, dim=0)  # [heads, L, D]
            values = _slot_keys(v_cache, tables, slot, position + 1).repeat_interleave(group, dim=0)
            want = F.scaled_dot_product_attention(q[b, t][:, None], keys, values)[:, 0]  # [heads, head_dim]
            torch.testing.assert_close(got[b, t], want, atol=1e-5, rtol=1e-5)


def test_wrapper_rejects_what_the_kernel_would_misread():
    q, k_cache, v_cache, tables, slot_ids, positions = _inputs(2, 1, 2, 2, 64, torch.float32, [3, 9])
    with pytest.raises(ValueError, match="dtypes"):
        slot_attention(q.bfloat16(), k_cache, v_cache, tables, slot_ids, positions)
    with pytest.raises(ValueError, match="evenly"):
        slot_attention(q[:, :, :3], k_cache, v_cache, tables, slot_ids, positions)
    with pytest.raises(ValueError, match="int64"):
        slot_attention(q, k_cache, v_cache, tables, slot_ids.int(), positions)
    with pytest.raises(ValueError, match="contiguous int64"):
        slot_attention(q, k_cache, v_cache, tables, torch.stack([slot_ids, slot_ids], dim=1)[:, 0], positions)
    with pytest.raises(ValueError, match="positions"):
        slot_attention(q, k_cache, v_cache, tables, slot_ids, positions[:1])
    with pytest.raises(ValueError, match="block_tables"):
        slot_attention(q, k_cache, v_cache, tables.long(), slot_ids, positions)


def test_kernel_compiles_for_sm90():
    """The compiler (not the interpreter) accepts the kernel in bf16 and fp32, head_dim 64 and 128."""
    script = textwrap.dedent(
        """
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from tandem.model.slot_attention import _slot_attention_kernel as kernel
        count = 0
        for dtype in ("bf16", "fp32"):
            for head_dim in (64, 128):
                signature = {"out_ptr": f"*{dtype}", "q_ptr": f"*{dtype}", "k_ptr": f"*{dtype}",
                             "v_ptr": f"*{dtype}", "tables_ptr": "*i32", "slot_ids_ptr": "*i64",
                             "positions_ptr": "*i64", "num_new": "i32", "group": "i32", "scale": "fp32",
                             "q_batch_stride": "i32", "q_token_stride": "i32", "q_head_stride": "i32",
                             "cache_head_stride": "i64", "table_stride": "i32",
                             "HEAD_DIM": "constexpr", "BLOCK_N": "constexpr", "PAGE": "constexpr"}
                ordered = {name: signature[name] for name in kernel.arg_names}
                source = ASTSource(kernel, ordered, {"HEAD_DIM": head_dim, "BLOCK_N": 64, "PAGE": 16})
                compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32))
                assert "ptx" in compiled.asm
                count += 1
        print("compiled", count)
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TANDEM_TRITON": "1"}
    root = Path(__file__).parents[2]
    run = subprocess.run([sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "compiled 4" in run.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the services need triton")
def test_services_on_a_cpu_do_not_import_triton():
    """Without a GPU or the interpreter, triton can launch nothing; importing it would cost each
    service 90 MB of resident memory and 0.3 s of start."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TANDEM_TRITON")}
    code = "import sys, target_service.__main__, draft_service.__main__; print('triton' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
