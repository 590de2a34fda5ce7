"""--quantization and --block-activations: what each choice loads, and the errors a user gets."""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from bench.greedy import greedy_generate
from draft_service.config import DraftConfig
from target_service.config import TargetConfig
from tandem.model import native
from tandem.model.random_weights import SHAPES, random_weights
from tandem.quantization import quantize
from tandem.runtime import load_model
from tests.support.devices import needs_native
from tests.support.tiny_checkpoint import write_tiny_model



def _types(loaded) -> set[Q]:
    decoder = loaded.model.decoder
    assert decoder.kind == native.WEIGHTS_BLOCKS
    return decoder.block_types


@needs_native
def test_auto_runs_the_embedded_gguf_in_its_blocks_and_none_in_bf16():
    assert _types(load_model("smollm2-135m", num_slots=1, max_model_len=64)) == {Q.Q4_1, Q.Q8_0}
    plain = load_model("smollm2-135m", num_slots=1, max_model_len=64, quantization="none")
    assert plain.model.decoder.kind == native.WEIGHTS_BF16


@needs_native
def test_block_activations_int8_reach_the_decoder_and_keep_a_prompts_next_token():
    """--block-activations int8: the same blocks, inputs in int8; on the embedded model a short
    prompt's greedy next tokens stay the int16 ones (a check that the choice reaches the forward
    and that it computes the model, not an equality the formats owe each other in general)."""
    loaded = {name: load_model("smollm2-135m", num_slots=1, max_model_len=64, block_activations=name)
              for name in ("int16", "int8")}
    assert loaded["int8"].model.decoder.kind == native.WEIGHTS_BLOCKS_X8
    assert loaded["int8"].model.decoder.block_types == {Q.Q4_1, Q.Q8_0}
    ids = loaded["int16"].tokenizer.encode("The capital of France is")
    tokens = {name: greedy_generate(one.model, ids, 4) for name, one in loaded.items()}
    assert tokens["int8"] == tokens["int16"]
    with pytest.raises(ValueError, match="--block-activations must be one of int16, int8, got 'int4'"):
        load_model("smollm2-135m", num_slots=1, max_model_len=64, block_activations="int4")


@needs_native
def test_block_activations_int8_on_float_weights_says_it_does_not_apply(caplog):
    with caplog.at_level("WARNING", logger="tandem.runtime"):
        loaded = load_model("smollm2-135m", num_slots=1, max_model_len=64, quantization="none",
                            block_activations="int8")
    assert loaded.model.decoder.kind == native.WEIGHTS_BF16
    assert "--block-activations int8 applies to GGUF block weights" in caplog.text


@needs_native
@pytest.mark.parametrize("name, ggml_type", [("q8_0", Q.Q8_0), ("q4_0", Q.Q4_0)])
def test_an_hf_folder_is_quantized_at_load_when_asked(tmp_path, name, ggml_type):
    folder = write_tiny_model(tmp_path / "hf", seed=0, head_dim=32)
    assert load_model(str(folder), num_slots=1, max_model_len=64).model.decoder.kind == native.WEIGHTS_BF16
    assert _types(load_model(str(folder), num_slots=1, max_model_len=64, quantization=name)) == {ggml_type}


def test_a_model_the_native_decoder_cannot_run_in_blocks_is_refused_with_the_way_out(tmp_path):
    folder = write_tiny_model(tmp_path / "hf", seed=0)  # head_dim 16: not a whole block
    with pytest.raises(ValueError, match="use --quantization none"):
        load_model(str(folder), num_slots=1, max_model_len=64, quantization="q8_0")
    config = SHAPES["tiny"]
    with pytest.raises(ValueError, match="can't run this model on cuda"):
        quantize(random_weights(config), "q4_0", config, torch.bfloat16, torch.device("cuda"))


def test_an_unknown_quantization_is_refused_by_both_services():
    with pytest.raises(ValueError, match="--quantization must be one of auto, none, q8_0, q4_0, got 'int4'"):
        TargetConfig(quantization="int4")
    with pytest.raises(ValueError, match="--quantization must be one of auto, none, q8_0, q4_0, got 'int4'"):
        DraftConfig(quantization="int4")
