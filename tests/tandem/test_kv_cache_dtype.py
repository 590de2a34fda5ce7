"""--kv-cache-dtype: what each choice keeps the KV cache in, and the errors a user gets."""
from __future__ import annotations

import pytest
import torch

from draft_service.config import DraftConfig
from target_service.config import TargetConfig
from tandem.runtime import load_model
from tests.support.devices import needs_native


def _cache_dtype(**kwargs) -> torch.dtype:
    loaded = load_model("smollm2-135m", num_slots=1, max_model_len=64, **kwargs)
    return loaded.model.kv_cache.k[0].dtype


@needs_native
def test_auto_keeps_a_gguf_in_blocks_in_fp16_and_a_float_model_in_its_dtype():
    assert _cache_dtype() == torch.float16
    assert _cache_dtype(dtype="float32") == torch.float32
    assert _cache_dtype(quantization="none") == torch.bfloat16
    assert _cache_dtype(quantization="none", dtype="float32") == torch.float32


@needs_native
@pytest.mark.parametrize("quantization, name, dtype", [("auto", "bfloat16", torch.bfloat16),
                                                       ("auto", "float32", torch.float32),
                                                       ("none", "float16", torch.float16)])
def test_a_named_dtype_is_kept(quantization, name, dtype):
    assert _cache_dtype(quantization=quantization, kv_cache_dtype=name) == dtype


def test_an_unknown_kv_cache_dtype_is_refused_by_both_services():
    message = "--kv-cache-dtype must be one of auto, bfloat16, float16, float32, got 'fp8'"
    with pytest.raises(ValueError, match=message):
        TargetConfig(kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match=message):
        DraftConfig(kv_cache_dtype="fp8")


def test_on_cuda_a_kv_cache_dtype_other_than_the_compute_dtype_is_refused_before_loading():
    """Only the native CPU decoder keeps its cache in another type; the check needs no GPU."""
    message = "--kv-cache-dtype float16 on cuda needs --dtype float16"
    with pytest.raises(ValueError, match=message):
        TargetConfig(device="cuda", kv_cache_dtype="float16")
    with pytest.raises(ValueError, match=message):
        DraftConfig(device="cuda", kv_cache_dtype="float16")
    assert TargetConfig(device="cuda", dtype="float16", kv_cache_dtype="float16").kv_cache_dtype == "float16"
    assert TargetConfig(device="cuda", kv_cache_dtype="bfloat16").kv_cache_dtype == "bfloat16"  # auto: bf16
