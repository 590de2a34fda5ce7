"""The HF-folder path: tiny random checkpoints written by save_pretrained load and match transformers."""
from __future__ import annotations

import pytest
import torch

from tandem.config import UnsupportedModelError
from tandem.loaders import CheckpointError, load_checkpoint
from tandem.model.batch import SequenceChunk
from tandem.model.llama import build_model

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def _save_llama(folder, **extra):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY, **extra)).eval()
    model.save_pretrained(folder, max_shard_size="100KB")  # sharded, with an index file
    return model


def _save_qwen2(folder):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(1)
    model = Qwen2ForCausalLM(Qwen2Config(**TINY, tie_word_embeddings=False)).eval()
    with torch.no_grad():  # random init leaves biases at zero; make them matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    model.save_pretrained(folder)
    return model


def _compare(folder, hf_model):
    config, weights = load_checkpoint(folder)
    ours = build_model(config, weights, dtype=torch.float32, device=torch.device("cpu"),
                       num_slots=1, max_model_len=64)
    ids = [3, 17, 99, 5, 64, 2, 127, 40, 8, 11]
    got = ours.run([SequenceChunk(slot=0, start=0, token_ids=ids, num_logits=len(ids))])
    with torch.no_grad():
        want = hf_model(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_tiny_llama_sharded(tmp_path):
    hf_model = _save_llama(tmp_path)
    assert (tmp_path / "model.safetensors.index.json").exists()
    _compare(tmp_path, hf_model)


def test_tiny_llama3_rope_scaling(tmp_path):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
    hf_model = _save_llama(tmp_path, rope_scaling=scaling, rope_theta=500000.0, tie_word_embeddings=True)
    _compare(tmp_path, hf_model)


def test_tiny_qwen2_with_attention_bias(tmp_path):
    hf_model = _save_qwen2(tmp_path)
    _compare(tmp_path, hf_model)


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        load_checkpoint(tmp_path)


def test_missing_weights_is_a_clear_error(tmp_path):
    _save_llama(tmp_path)
    for shard in tmp_path.glob("*.safetensors"):
        shard.unlink()
    (tmp_path / "model.safetensors.index.json").unlink()
    with pytest.raises(CheckpointError, match="no .safetensors"):
        load_checkpoint(tmp_path)
