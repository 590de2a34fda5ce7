"""The distilled drafter: training math equals the runtime's, runs repeat, files load only on their target."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from training.__main__ import run
from training.config import DistillConfig
from training.student import Student
from training.train import draft_vocabulary, split_held_out
from training.teacher import TeacherSequence, load_teacher_data
from tandem.loaders import CheckpointError, load_checkpoint
from tandem.loaders.drafter_file import read_drafter_file
from tandem.model import native
from tandem.model.batch import SequenceChunk
from tandem.model.rope import rope_inv_freq
from tandem.runtime import load_model
from tests.support.tiny_checkpoint import VOCAB, write_tiny_drafter, write_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("distill")
    write_tiny_model(root / "target", seed=0)
    write_tiny_model(root / "other", seed=1)
    return root


def _distill(tiny: Path, out: str, seed: int = 0, teacher_data: str = "", max_new_tokens: int = 16,
             samples_per_prompt: int = 1, ship_vocab: int = 0) -> dict:
    config = DistillConfig(target=str(tiny / "target"), out=str(tiny / out), num_prompts=24,
                           samples_per_prompt=samples_per_prompt, max_new_tokens=max_new_tokens,
                           generation_batch=8, layers=1, draft_vocab=20, ship_vocab=ship_vocab, steps=40,
                           eval_every=1000, held_out=0.25, seed=seed, device="cpu", teacher_data=teacher_data)
    return run(config)


def test_student_logits_equal_the_runtime_drafter_on_the_same_weights(tiny):
    vocab = [0, 2, 3, 5, 8, 13, 21, 31]
    path = write_tiny_drafter(tiny / "parity.safetensors", tiny / "target", tiny / "other", vocab)
    drafter = read_drafter_file(path)
    config, weights = load_checkpoint(tiny / "target")
    student = Student(config, drafter.layers, drafter.norm, weights.embed, weights.lm_head[drafter.draft_vocab],
                      rope_inv_freq(config), max_len=64, device=torch.device("cpu"))
    tokens = [3, 17, 9, 25, 4, 4, 30, 1, 2]
    with torch.no_grad():
        expected = student(torch.tensor([tokens]))[0]  # [T, N]
    loaded = load_model(str(path), drafter_target=str(tiny / "target"), max_model_len=64, dtype="float32")
    got = loaded.model.run([SequenceChunk(0, 0, tokens, num_logits=len(tokens))])  # [T, N]
    assert loaded.draft_vocab.tolist() == vocab
    assert got.shape == (len(tokens), len(vocab))
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_a_drafter_file_refuses_a_target_it_was_not_trained_for(tiny):
    path = write_tiny_drafter(tiny / "wrong.safetensors", tiny / "target", tiny / "target", list(range(VOCAB)))
    with pytest.raises(CheckpointError, match="fingerprint"):
        load_model(str(path), drafter_target=str(tiny / "other"), max_model_len=64)


def test_distillation_repeats_exactly_and_raises_held_out_acceptance(tiny, caplog):
    """The second run reads the teacher data the first one cached: the same data, so the same weights."""
    cache = str(tiny / "teacher.pt")
    first = _distill(tiny, "a.safetensors", teacher_data=cache)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="training"):
        second = _distill(tiny, "b.safetensors", teacher_data=cache)
    assert "24 teacher sequences wanted: 24 cached, 0 to generate" in caplog.text
    a, b = read_drafter_file(tiny / "a.safetensors"), read_drafter_file(tiny / "b.safetensors")
    assert torch.equal(a.draft_vocab, b.draft_vocab) and len(a.draft_vocab) == 20
    assert torch.equal(a.norm, b.norm)
    for la, lb in zip(a.layers, b.layers, strict=True):
        for name in ("attn_norm", "qkv", "o", "mlp_norm", "gate_up", "down"):
            assert torch.equal(getattr(la, name), getattr(lb, name)), name
    assert first["held_out_after"] == second["held_out_after"]
    before, after = first["held_out_before"], first["held_out_after"]
    assert after["alpha"] > before["alpha"] + 0.05
    assert after["alpha"] <= after["coverage"] + 1e-6  # q is zero outside the draft vocabulary
    different = _distill(tiny, "c.safetensors", seed=1)
    assert different["held_out_after"] != first["held_out_after"]


def test_draft_vocabulary_takes_the_most_frequent_completion_tokens():
    hidden = torch.zeros(1, 4)
    sequences = [TeacherSequence([9, 9, 1, 1, 1, 2, 2, 7], prompt_len=2, hidden=hidden)]
    # Completion [1, 1, 1, 2, 2, 7]: 1 then 2 then 7; the prompt's 9 does not count; ties fill with low ids.
    assert draft_vocabulary(sequences, 2, 10).tolist() == [1, 2]
    assert draft_vocabulary(sequences, 5, 10).tolist() == [0, 1, 2, 3, 7]
    with pytest.raises(ValueError, match="draft-vocab"):
        draft_vocabulary(sequences, 11, 10)


def test_a_drafter_file_runs_in_bfloat16_unless_told_otherwise(tiny, monkeypatch):
    """Even on a CPU where a plain checkpoint's auto dtype is fp32 (no native decoder)."""
    monkeypatch.setenv("TANDEM_NATIVE", "0")
    native.load.cache_clear()
    try:
        path = write_tiny_drafter(tiny / "dtype.safetensors", tiny / "target", tiny / "other", list(range(VOCAB)))
        assert load_model(str(path), drafter_target=str(tiny / "target"),
                          max_model_len=64).model.dtype == torch.bfloat16
        assert load_model(str(tiny / "target"), max_model_len=64).model.dtype == torch.float32
        assert load_model(str(path), drafter_target=str(tiny / "target"), max_model_len=64,
                          dtype="float32").model.dtype == torch.float32
    finally:
        native.load.cache_clear()


def test_auto_dtype_is_bfloat16_where_the_native_decoder_runs(tiny):
    """bf16 decodes twice as fast on the CPU here (README, Speed on CPU); fp32 where only PyTorch runs."""
    expected = torch.bfloat16 if native.load() is not None else torch.float32
    assert load_model(str(tiny / "target"), max_model_len=64).model.dtype == expected


def test_cached_teacher_data_from_other_flags_is_refused(tiny):
    cache = str(tiny / "teacher-other.pt")
    _distill(tiny, "d.safetensors", teacher_data=cache)
    with pytest.raises(ValueError, match="max_new_tokens"):
        _distill(tiny, "e.safetensors", teacher_data=cache, max_new_tokens=8)


def test_the_teacher_cache_grows_by_the_sequences_it_lacks(tiny, caplog):
    cache = tiny / "grow.pt"
    _distill(tiny, "f.safetensors", teacher_data=str(cache))
    key = torch.load(cache, weights_only=True)["key"]
    first = load_teacher_data(cache, key)
    with caplog.at_level(logging.INFO, logger="training"):
        grown_run = _distill(tiny, "g.safetensors", teacher_data=str(cache), samples_per_prompt=2, ship_vocab=8)
    assert "48 teacher sequences wanted: 24 cached, 24 to generate" in caplog.text
    grown = load_teacher_data(cache, key)
    assert sorted(grown) == [(s, i) for s in range(2) for i in range(24)]
    for entry, sequence in first.items():
        assert grown[entry].token_ids == sequence.token_ids
        assert torch.equal(grown[entry].hidden, sequence.hidden)
    second_samples = [grown[(1, i)] for i in range(24)]
    for i, sequence in enumerate(second_samples):  # the same prompt, another seed
        assert sequence.token_ids[: sequence.prompt_len] == first[(0, i)].token_ids[: sequence.prompt_len]
    assert sum(s.token_ids != first[(0, i)].token_ids for i, s in enumerate(second_samples)) > 12
    # The shipped head keeps the rows of the 8 most frequent completion tokens of the training split.
    train_set, _ = split_held_out([grown[e] for e in sorted(grown)], 0.25, 0)
    shipped = read_drafter_file(tiny / "g.safetensors").draft_vocab
    assert shipped.tolist() == draft_vocabulary(train_set, 8, VOCAB).tolist()
    assert grown_run["held_out_shipped"]["coverage"] < grown_run["held_out_after"]["coverage"]


# ---- the EAGLE-3 head ----------------------------------------------------------------------------

def _distill_eagle(tiny: Path, out: str, ttt_steps: int = 3) -> dict:
    config = DistillConfig(kind="eagle3", target=str(tiny / "target"), out=str(tiny / out), num_prompts=24,
                           max_new_tokens=16, generation_batch=8, draft_vocab=20, steps=60, lr=3e-3,
                           eval_every=1000, held_out=0.25, seed=0, device="cpu", feature_layers="0,1",
                           ttt_steps=ttt_steps, ttt_from=0.5, teacher_data=str(tiny / "eagle-teacher.pt"))
    return run(config)


def test_the_trained_heads_math_is_the_serving_heads_at_every_unrolled_step(tiny):
    from training.eagle import EagleStudent, make_eagle_batch, teacher_features
    from tandem.model.eagle3 import Eagle3Model
    from tandem.model.llama import build_model

    config, weights = load_checkpoint(tiny / "target")
    vocab = torch.tensor([0, 2, 3, 5, 8, 13, 21, 31])
    student = EagleStudent(config, weights.layers[-1], weights.norm, weights.embed, weights.lm_head[vocab], vocab,
                           (0, 1), rope_inv_freq(config), max_len=64, device=torch.device("cpu"), seed=3)
    with torch.no_grad():  # training moves every part off its start, so that the check covers them all
        for p in student.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
    tokens = [3, 17, 9, 25, 4, 4, 30, 1, 2, 7]
    sequence = TeacherSequence(tokens, 2, torch.zeros(len(tokens) - 1, config.hidden_size))
    target = build_model(config, weights, dtype=torch.float32, device=torch.device("cpu"), num_slots=1,
                         max_model_len=64)
    [features] = teacher_features(target, [sequence], (0, 1))
    with torch.no_grad():
        steps = [(h @ student.head.T)[0] for h in student.unrolled(make_eagle_batch([sequence], [features],
                                                                                    torch.device("cpu")), 3)]
    head = Eagle3Model(*student.export(config.hidden_size), dtype=torch.float32, device="cpu", num_slots=2,
                       max_model_len=64)
    head.load_features(0, 0, features)
    torch.testing.assert_close(head.run([SequenceChunk(0, 0, tokens[:-1], num_logits=9)]), steps[0],
                               rtol=1e-4, atol=1e-4)
    committed = 6  # tokens 0..5 committed, the target has read 0..4; then tokens 6, 7 fed as drafts
    serving = Eagle3Model(*student.export(config.hidden_size), dtype=torch.float32, device="cpu", num_slots=2,
                          max_model_len=64)
    serving.load_features(1, 0, features[: committed - 1])
    serving.run([SequenceChunk(1, 0, tokens[:committed])])
    for depth in (1, 2):
        position = committed + depth - 1
        got = serving.run([SequenceChunk(1, position, [tokens[position]])])[0]
        torch.testing.assert_close(got, steps[depth][position], rtol=1e-4, atol=1e-4)


def test_eagle_distillation_repeats_raises_agreement_and_loads_only_on_its_target(tiny):
    from tandem.loaders.eagle3 import load_eagle3
    from tandem.runtime import load_eagle3_head

    first = _distill_eagle(tiny, "eagle-a")
    second = _distill_eagle(tiny, "eagle-b")
    assert first["held_out_after"] == second["held_out_after"]
    before, after = first["held_out_before"], first["held_out_after"]
    assert after["depth_agreement"][0] > before["depth_agreement"][0] + 0.05
    assert after["mean_accepted_length"] > before["mean_accepted_length"]
    config, weights = load_checkpoint(tiny / "target")
    head_config, _ = load_eagle3(tiny / "eagle-a", config, weights)
    assert head_config.feature_layers == (0, 1) and head_config.draft_vocab_size == 20
    assert load_eagle3_head(str(tiny / "eagle-a"), str(tiny / "target"), max_model_len=64).model.eagle == head_config
    with pytest.raises(CheckpointError, match="another target"):
        load_eagle3_head(str(tiny / "eagle-a"), str(tiny / "other"), max_model_len=64)
