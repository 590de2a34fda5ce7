"""The EAGLE-3 head: its checkpoint layout, and its forward against a from-scratch reference."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.loaders import CheckpointError
from tandem.loaders.eagle3 import load_eagle3, save_eagle3
from tandem.model.batch import SequenceChunk
from tandem.model.eagle3 import Eagle3Model, default_feature_layers
from tandem.model.random_weights import SHAPES, random_weights
from tandem.model.rope import rope_inv_freq
from tests.support.tiny_eagle3 import write_eagle3_head

TARGET = SHAPES["tiny"]
DRAFT_IDS = list(range(3, 200, 2))


@pytest.fixture(scope="module")
def target_weights():
    return random_weights(TARGET, seed=3)


@pytest.fixture
def head(tmp_path, target_weights):
    write_eagle3_head(tmp_path / "head", TARGET, [0, 1], DRAFT_IDS)
    return load_eagle3(tmp_path / "head", TARGET, target_weights)


def test_the_published_layout_loads_with_the_targets_embedding(tmp_path, head, target_weights):
    config, weights = head
    assert config.feature_layers == (0, 1) and config.draft_vocab_size == len(DRAFT_IDS)
    assert weights.draft_ids.tolist() == DRAFT_IDS
    assert torch.equal(weights.embed, target_weights.embed)
    assert weights.qkv.shape == ((TARGET.num_heads + 2 * TARGET.num_kv_heads) * TARGET.head_dim,
                                 2 * TARGET.hidden_size)
    save_eagle3(tmp_path / "again", config, weights)
    again_config, again = load_eagle3(tmp_path / "again", TARGET, target_weights)
    assert again_config == config
    for name in weights.__slots__:
        assert torch.equal(getattr(again, name), getattr(weights, name)), name


def test_a_head_with_its_own_embedding_and_no_layer_list(tmp_path, target_weights):
    write_eagle3_head(tmp_path / "head", TARGET, None, DRAFT_IDS, with_embedding=True)
    config, weights = load_eagle3(tmp_path / "head", TARGET, target_weights)
    assert config.feature_layers == default_feature_layers(TARGET.num_layers) == (0, 1)
    assert not torch.equal(weights.embed, target_weights.embed)
    assert default_feature_layers(30) == (2, 15, 27)  # SmolLM2-135M, as vLLM picks them


@pytest.mark.parametrize("change, message", [
    (dict(skip=("fc.weight",)), "no tensor 'fc.weight'"),
    (dict(skip=("d2t",)), "no tensor 'd2t'"),
    (dict(layers=[0, 2]), "target layers"),
    (dict(draft_ids=[5, 300]), "outside the target's vocabulary"),
])
def test_a_broken_head_is_refused_with_what_is_wrong(tmp_path, target_weights, change, message):
    args = dict(layers=[0, 1], draft_ids=DRAFT_IDS, skip=())
    args.update(change)
    write_eagle3_head(tmp_path / "head", TARGET, args["layers"], args["draft_ids"], skip=args["skip"])
    with pytest.raises(CheckpointError, match=message):
        load_eagle3(tmp_path / "head", TARGET, target_weights)


def _reference(head, tokens: list[int], features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [n, draft_vocab] and output hidden [n, hidden] of every row, computed from scratch:
    row p reads token p and the fused feature of position p - 1 (zeros at p = 0)."""
    config, w = head
    cfg = config.layer
    n = len(tokens)
    fused = F.linear(features.reshape(len(features), -1), w.fc)
    feature = torch.cat([torch.zeros(1, cfg.hidden_size), fused])[:n]

    def norm(x, weight):
        return F.rms_norm(x, weight.shape, weight, cfg.rms_norm_eps)

    x = torch.cat([norm(w.embed[tokens], w.input_norm), norm(feature, w.hidden_norm)], dim=1)
    q, k, v = F.linear(x, w.qkv).split([cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim,
                                        cfg.num_kv_heads * cfg.head_dim], dim=1)
    angles = torch.outer(torch.arange(n, dtype=torch.float64), rope_inv_freq(cfg).double()).float()

    def rotate(t, heads):
        t = t.view(n, heads, cfg.head_dim)
        a, b = t.chunk(2, dim=-1)
        cos, sin = angles.cos()[:, None], angles.sin()[:, None]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1).transpose(0, 1)

    q, k = rotate(q, cfg.num_heads), rotate(k, cfg.num_kv_heads)
    v = v.view(n, cfg.num_kv_heads, cfg.head_dim).transpose(0, 1)
    group = cfg.num_heads // cfg.num_kv_heads
    attn = F.scaled_dot_product_attention(q, k.repeat_interleave(group, 0), v.repeat_interleave(group, 0),
                                          is_causal=True)
    hidden = feature + F.linear(attn.transpose(0, 1).reshape(n, -1), w.o)
    gate, up = F.linear(norm(hidden, w.post_norm), w.gate_up).chunk(2, dim=-1)
    hidden = hidden + F.linear(F.silu(gate) * up, w.down)
    return F.linear(norm(hidden, w.norm), w.lm_head), hidden


def _model(head) -> Eagle3Model:
    return Eagle3Model(*head, dtype=torch.float32, device="cpu", num_slots=3, max_model_len=64)


def test_rows_match_the_reference_whole_or_a_token_at_a_time(head):
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, TARGET.vocab_size, (12,), generator=g).tolist()
    features = torch.randn(11, 2, TARGET.hidden_size, generator=g)  # positions 0..10
    want, _ = _reference(head, tokens, features)
    whole = _model(head)
    whole.load_features(1, 0, features)
    torch.testing.assert_close(whole.run([SequenceChunk(1, 0, tokens, num_logits=12)]), want, atol=1e-4, rtol=1e-4)
    assert whole.kv_cache.exact_rows[1] == 12
    stepwise = _model(head)
    stepwise.load_features(0, 0, features[:4])
    got = [stepwise.run([SequenceChunk(0, 0, tokens[:5], num_logits=5)])]
    for p in range(5, 12):
        stepwise.load_features(0, p - 1, features[p - 1 : p])
        got.append(stepwise.run([SequenceChunk(0, p, [tokens[p]]), SequenceChunk(2, 0, tokens[:3])])[:1])
    torch.testing.assert_close(torch.cat(got), want, atol=1e-4, rtol=1e-4)


def test_past_the_targets_features_a_row_reads_the_heads_own_prediction(head):
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, TARGET.vocab_size, (8,), generator=g).tolist()
    features = torch.randn(7, 2, TARGET.hidden_size, generator=g)
    model = _model(head)
    model.load_features(0, 0, features[:5])  # the target has read positions 0..4: committed tokens 0..5
    model.run([SequenceChunk(0, 0, tokens[:6])])
    draft_logits = model.run([SequenceChunk(0, 6, [tokens[6]])])  # a draft at position 6
    _, hidden = _reference(head, tokens[:6], features[:5])
    predicted = torch.cat([features[:5].reshape(5, -1) @ head[1].fc.T, hidden[5:6]])  # fused, then predicted
    config, w = head
    # The same rows with the fused features given directly: an fc that passes them through.
    passthrough = (config, type(w)(**{**{n: getattr(w, n) for n in w.__slots__},
                                      "fc": torch.eye(TARGET.hidden_size, 2 * TARGET.hidden_size)}))
    padded = torch.cat([predicted, torch.zeros(6, TARGET.hidden_size)], dim=1).view(6, 2, -1)
    want, _ = _reference(passthrough, tokens[:7], padded)
    torch.testing.assert_close(draft_logits, want[6:], atol=1e-4, rtol=1e-4)
    assert model.kv_cache.exact_rows[0] == 6  # the draft's row read a predicted feature
    model.load_features(0, 5, features[5:6])  # the target committed it: its row is recomputed
    assert model.kv_cache.exact_rows[0] == 6 and model.kv_cache.target_len[0] == 6


def test_loading_no_rows_forgets_the_features_past_that_position(head):
    """What a slot taken over from another sequence gets when no new feature has come: the earlier
    sequence's features past the shared prefix no longer count, and nothing else changes."""
    model = _model(head)
    features = _features(6)
    model.load_features(0, 0, features)
    model.run([SequenceChunk(0, 0, list(range(10, 18)))])
    cache = model.kv_cache
    kept = cache.features[0, :3].clone()
    model.load_features(0, 3, features[6:])  # [0, layers, hidden]
    assert (cache.target_len[0], cache.exact_rows[0]) == (3, 4)
    assert torch.equal(cache.features[0, :3], kept)
    model.load_features(0, 3, features[6:])  # nothing new twice: the same
    assert (cache.target_len[0], cache.exact_rows[0]) == (3, 4)


# ---- the draft service's side: features arrive with Extends, are checked, and drive the drafts ----

from draft_service.drafters.eagle3 import Eagle3Drafter  # noqa: E402
from draft_service.metrics import DraftMetrics  # noqa: E402
from draft_service.drafters.ngram import NgramDrafter  # noqa: E402
from draft_service.scheduler import Limits  # noqa: E402
from tests.support.draft_schedulers import running_scheduler  # noqa: E402
from tandem.hidden_states import FeatureLayout  # noqa: E402
from tandem.v1 import drafter_pb2 as pb  # noqa: E402

LIMITS = Limits(vocab_size=TARGET.vocab_size, max_model_len=64, max_k=4, num_slots=4)
PROMPT = [5, 9, 11, 7, 3, 20]
LAYOUT = FeatureLayout((0, 1), TARGET.hidden_size)


def _features(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, 2, TARGET.hidden_size, generator=torch.Generator().manual_seed(seed))


def _extend(start: int, tokens: list[int], hidden_start: int = 0, features: torch.Tensor | None = None,
            data: bytes | None = None) -> pb.TargetUpdate:
    extend = pb.SequenceExtend(seq_id=1, start=start, token_ids=tokens, hidden_start=hidden_start)
    extend.hidden_states = data if data is not None else (LAYOUT.encode(features) if features is not None else b"")
    return pb.TargetUpdate(extends=[extend])


def _invalid(metrics: DraftMetrics, reason: str) -> float:
    return metrics.registry.get_sample_value(
        "tandem_draft_invalid_updates_total", {"model": "test", "service": "draft", "reason": reason}) or 0


async def _next(stream) -> pb.DraftProposal:
    import asyncio

    [proposal] = (await asyncio.wait_for(stream.outbox.get(), 10)).proposals
    return proposal


async def test_the_head_drafts_once_the_features_come_and_refuses_bad_ones(head):
    metrics = DraftMetrics("test")
    async with running_scheduler(Eagle3Drafter(_model(head), 8, metrics), metrics, LIMITS) as scheduler:
        stream = scheduler.open_stream()
        scheduler.apply(stream, pb.TargetUpdate(opens=[pb.SequenceOpen(seq_id=1, prompt_ids=PROMPT, k=3)]))
        opened = await _next(stream)
        assert (opened.base_len, list(opened.token_ids)) == (6, [])  # no features yet: nothing to draft from
        scheduler.apply(stream, _extend(6, [4], 0, _features(6)))  # the prompt's 6 positions
        drafted = await _next(stream)
        assert drafted.base_len == 7 and len(drafted.token_ids) == 3
        assert all(t in DRAFT_IDS for t in drafted.token_ids)

        for bad, reason_text in ((_extend(7, [8], 6, data=b"\x00" * 10), "bytes"),
                                 (_extend(8, [8], 9, _features(1)), "hidden_start"),
                                 (_extend(9, [8], 8, _features(1) * float("nan")), "NaN")):
            before = _invalid(metrics, "bad_hidden_states")
            scheduler.apply(stream, bad)
            assert _invalid(metrics, "bad_hidden_states") == before + 1, reason_text
            answer = await _next(stream)  # the tokens stand; the features did not reach them
            assert (answer.base_len, list(answer.token_ids)) == (bad.extends[0].start + 1, []), reason_text

        scheduler.apply(stream, _extend(10, [2], 9, _features(1)))  # positions 6..8 never came: zeros
        healed = await _next(stream)
        assert healed.base_len == 11 and len(healed.token_ids) == 3


async def test_a_drafter_that_reads_no_features_refuses_them_but_keeps_the_tokens():
    metrics = DraftMetrics("test")
    async with running_scheduler(NgramDrafter(1, 4), metrics, LIMITS) as scheduler:
        stream = scheduler.open_stream()
        scheduler.apply(stream, pb.TargetUpdate(opens=[pb.SequenceOpen(seq_id=1, prompt_ids=PROMPT, k=3)]))
        await _next(stream)
        scheduler.apply(stream, _extend(6, [5], 0, _features(6)))
        assert _invalid(metrics, "bad_hidden_states") == 1
        assert (await _next(stream)).base_len == 7


@pytest.mark.parametrize("change, message", [
    (dict(target_hidden_size=32), "hidden size 32"),
    (dict(hidden_layers=[0, 2]), "below the target's 2 layers"),
    (dict(hidden_layers=[1, 0]), "distinct, ascending"),
])
def test_the_target_refuses_a_drafter_whose_features_it_cannot_send(change, message):
    from target_service.speculation.link import DrafterLink, IncompatibleDrafter

    link = DrafterLink("127.0.0.1:1", peer=None, metrics=None, vocab_size=256, tokenizer_fingerprint="f",
                       reconnect_max_seconds=1.0, max_message_bytes=1 << 20, num_layers=2, hidden_size=64)
    fields = dict(vocab_size=256, tokenizer_fingerprint="f", max_k=4, hidden_layers=[0, 1], target_hidden_size=64)
    link._check(pb.DrafterInfo(**fields))
    with pytest.raises(IncompatibleDrafter, match=message):
        link._check(pb.DrafterInfo(**{**fields, **change}))


def test_copying_positions_carries_the_features_and_how_far_they_are_the_targets(head):
    """A pre-draft's scratch slot: the shared prefix copied from the sequence's own slot."""
    model = _model(head)
    tokens = list(range(10, 20))
    model.load_features(0, 0, _features(6))
    model.run([SequenceChunk(0, 0, tokens[:8])])  # rows 0..6 read target features, row 7 a predicted one
    cache = model.kv_cache
    assert (cache.target_len[0], cache.exact_rows[0]) == (6, 7)
    model.load_features(1, 0, _features(3, seed=1))
    model.run([SequenceChunk(1, 0, tokens[:3])])
    cache.copy_positions(0, 1, 3, 8)  # slot 1 keeps its own 0..2, takes 3..7 from slot 0
    assert torch.equal(cache.features[1, 3:8], cache.features[0, 3:8])
    assert (cache.target_len[1], cache.exact_rows[1]) == (6, 7)
    cache.copy_positions(0, 2, 4, 8)  # a fresh slot has nothing before 4: its runs stay empty
    assert (cache.target_len[2], cache.exact_rows[2]) == (0, 0)
