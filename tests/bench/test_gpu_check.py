"""`make gpu-check` (bench/gpu_check.py) runs every part on CPU, on a tiny model: it has to work on
the first try on a GPU machine nobody here can reach."""
from __future__ import annotations

import json

import torch

from bench import gpu_check
from tandem.model.random_weights import SHAPES, random_weights

TINY = ["--device", "cpu", "--shape", "tiny", "--steps", "2", "--prompt-len", "16"]


def test_every_part_runs_and_lands_in_the_json(tmp_path):
    out = tmp_path / "gpu_check.json"
    assert gpu_check.main([*TINY, "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["errors"] == []
    assert report["tests"]["returncode"] == 0 and "skipped" in report["tests"]["summary"]  # no CUDA here
    assert report["bandwidth_gb_s"] > 0
    cells = {(r["path"], r["step"], r["batch"], r["tokens_per_step"]) for r in report["rows"]}
    assert cells == {(path, step, batch, batch * tokens) for path in ("eager", "graphs")
                     for step, tokens in (("decode", 1), ("verify", 5)) for batch in (1, 16)}
    assert all(r["ms_per_step"] > 0 and r["bound_ms"] > 0 and r["mb_per_step"] > 0 for r in report["rows"])


def test_a_failing_part_is_reported_and_the_rest_still_runs(tmp_path):
    out = tmp_path / "gpu_check.json"
    assert gpu_check.main([*TINY, "--shape", "no-such-shape", "--no-tests", "--out", str(out)]) == 1
    report = json.loads(out.read_text())
    assert report["bandwidth_gb_s"] > 0
    assert report["rows"] == [] and report["errors"] == ["steps: KeyError: 'no-such-shape'"]


def test_the_gpu_tests_are_found_by_their_mark():
    files = gpu_check.gpu_test_files()
    assert {"tests/tandem/test_model_gpu.py", "tests/tandem/test_slot_attention.py",
            "tests/tandem_kernels/test_kernels_triton.py"} <= set(files)
    assert "tests/bench/test_gpu_check.py" not in files


def test_weight_bytes_counts_a_tied_lm_head_once():
    config = SHAPES["tiny"]
    weights = random_weights(config, dtype=torch.bfloat16)
    c = config
    per_layer = (2 * c.hidden_size + (c.num_heads + 2 * c.num_kv_heads) * c.head_dim * c.hidden_size
                 + c.hidden_size * c.num_heads * c.head_dim + 3 * c.intermediate_size * c.hidden_size)
    expected = c.num_layers * per_layer + c.hidden_size + c.vocab_size * c.hidden_size
    assert gpu_check.weight_bytes(weights) == 2 * expected
