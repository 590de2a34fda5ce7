"""The draft-wait bound: as long as drafts are worth, and nothing when they come too late to be.
The draft budget: as many drafts per sequence as the step's expected tokens per second reward."""
from __future__ import annotations

import itertools
import random

import pytest

from target_service.config import TargetConfig
from target_service.speculation.policy import DraftRecord, SpeculationPolicy, speculation_policy


def _policy(draft_wait_ms: float, sync: bool = False) -> SpeculationPolicy:
    policy = speculation_policy(TargetConfig(draft_wait_ms=draft_wait_ms, sync_speculation=sync))
    for _ in range(200):  # long enough for the moving averages to settle
        policy.observe_step(1, 0.040, batch=1)
        policy.observe_verify(2, 4, DraftRecord())
    return policy


def test_the_bound_is_expected_accepted_tokens_times_step_time_capped_by_the_flag():
    assert _policy(draft_wait_ms=500).wait_bound() == pytest.approx(2 * 0.040, rel=1e-3)
    assert _policy(draft_wait_ms=30).wait_bound() == pytest.approx(0.030)
    assert _policy(draft_wait_ms=0).wait_bound() == 0


def test_a_drafter_slower_than_the_bound_is_not_waited_for_until_it_speeds_up():
    policy = _policy(draft_wait_ms=30)
    for _ in range(200):
        policy.observe_draft_rtt(0.100)
    assert policy.wait_bound() == 0
    for _ in range(200):
        policy.observe_draft_rtt(0.010)
    assert 0.010 < policy.wait_bound() < 0.012  # as long as its answers take, and a little more


def test_the_wait_follows_the_distribution_of_round_trips_not_their_mean():
    """Answers that mostly come in 5 ms and sometimes in 200 ms: wait for the quick ones only. The
    mean (about 100 ms) would say never wait; waiting for the slow ones would cost every step."""
    policy = _policy(draft_wait_ms=50)
    for rtt in itertools.islice(itertools.cycle((0.005, 0.005, 0.005, 0.200)), 64):
        policy.observe_draft_rtt(rtt)
    assert 0.005 < policy.wait_bound() <= 0.0061
    # Asked 4 ms ago: 1 ms more, for those. Asked 6 ms ago: the quick ones would have come, and the
    # slow ones come too late to wait for.
    assert 0.001 < policy.wait_bound(elapsed=0.004) < 0.0017
    assert policy.wait_bound(elapsed=0.006) == 0


def test_the_drafter_is_told_a_late_round_trip_and_the_step_interval():
    """It pre-drafts as many verifications ahead as the round trip spans: the slow tail counts."""
    policy = _policy(draft_wait_ms=30)
    assert (policy.late_round_trip(), policy.mean_cycle) == (0, 0)  # not measured: one verification ahead
    for rtt in itertools.islice(itertools.cycle([0.010] * 8 + [0.050, 0.060]), 60):
        policy.observe_draft_rtt(rtt)
    assert policy.late_round_trip() == 0.050
    policy.observe_cycle([], [], [], 0.030)
    assert policy.mean_cycle == 0.030  # the first cycle, then a moving average
    for _ in range(100):
        policy.observe_cycle([], [], [], 0.040)
    assert policy.mean_cycle == pytest.approx(0.040, abs=1e-4)


def test_answers_that_mostly_carry_nothing_are_not_waited_for():
    """An answer of nothing saves no step: the wait weighs the saving by the share of the sequence's
    answers that carry drafts, its own drawn towards the batch's."""
    policy = _policy(draft_wait_ms=50)  # the saving: 2 accepted x 40 ms
    for _ in range(64):
        policy.observe_draft_rtt(0.030)
    chat, copy = DraftRecord(), DraftRecord()
    assert 0.030 < policy.wait_bound(drafted=policy.drafted_share(chat)) < 0.034  # nothing measured: all carry drafts
    for i in range(100):
        policy.observe_drafts_answer(i % 5 == 0, chat)
        policy.observe_drafts_answer(True, copy)
    assert policy.drafted_share(chat) < 0.3 < 0.9 < policy.drafted_share(copy)
    assert policy.wait_bound(drafted=policy.drafted_share(chat)) == 0  # a quarter of 80 ms is less than the 33 ms wait
    assert 0.030 < policy.wait_bound(drafted=policy.drafted_share(copy)) < 0.034
    policy.new_drafter([chat, copy])  # another drafter: its answers are learnt anew
    assert policy.drafted_share(chat) == policy.drafted_share(copy) == 1.0


def test_no_step_waits_for_answers_the_round_trips_say_come_after_the_bound():
    policy = _policy(draft_wait_ms=30)
    for _ in range(64):
        policy.observe_draft_rtt(0.031)
    assert policy.wait_bound() == 0


def test_rejected_drafts_shrink_the_bound():
    policy = _policy(draft_wait_ms=500)
    for _ in range(200):
        policy.observe_verify(0, 4, DraftRecord())
    assert policy.wait_bound() < 0.001


def test_synchronous_speculation_waits_for_the_drafter_whatever_it_costs():
    policy = _policy(draft_wait_ms=3, sync=True)
    for _ in range(200):
        policy.observe_draft_rtt(0.5)
    assert policy.wait_bound() == 1.0


def test_a_silent_drafter_is_waited_for_only_until_its_patience_runs_out():
    policy = _policy(draft_wait_ms=30)  # bound 30 ms
    for _ in range(200):
        policy.observe_draft_rtt(0.005)
    assert policy.patience() == pytest.approx(0.030)  # four round trips are less than the bound
    wait = policy.wait_bound()
    assert 0.005 < wait < 0.007
    assert policy.wait_deadline(10.0, asked_at=10.0) == pytest.approx(10.0 + wait)
    policy.observe_update_sent(10.0)
    policy.observe_update_sent(10.020)  # the first unanswered update sets the clock
    assert policy.wait_deadline(10.020, asked_at=10.020) == pytest.approx(10.020 + wait)
    assert policy.wait_deadline(10.028, asked_at=10.028) == pytest.approx(10.030)  # patience ends first
    assert policy.wait_deadline(10.100, asked_at=10.100) < 10.100  # silent past its patience: no wait at all
    policy.observe_answer()
    assert policy.wait_deadline(10.100, asked_at=10.100) == pytest.approx(10.100 + wait)


def test_patience_grows_with_the_drafter_round_trip():
    policy = _policy(draft_wait_ms=30)
    for _ in range(200):
        policy.observe_draft_rtt(0.020)
    assert policy.patience() == pytest.approx(0.080, rel=1e-3)
    assert _policy(draft_wait_ms=3, sync=True).patience() == 1.0


def _fitted(fixed: float, per_token: float, alpha: float, sync: bool = False) -> SpeculationPolicy:
    """A policy that has seen steps of several sizes cost fixed + per_token * n, and drafts accepted
    at a rate alpha (ten verifications of one draft, alpha * 10 of them accepted, repeated)."""
    policy = speculation_policy(TargetConfig(sync_speculation=sync))
    for step in range(400):
        n = (1, 4, 16, 48)[step % 4]
        policy.observe_step(n, fixed + per_token * n, batch=n)
    for i in range(400):
        policy.observe_verify(int(i % 10 < alpha * 10), 1, DraftRecord())
    assert policy.alpha == pytest.approx(alpha, abs=0.05)
    return policy


def _veterans(batch_size: int) -> list[DraftRecord]:
    """Records of sequences with 16 judged drafts of their own, to be set by _aligned to the batch's alpha,
    so that their own alpha is the batch's."""
    return [DraftRecord(judged=16.0) for _ in range(batch_size)]


def _aligned(policy: SpeculationPolicy, records: list[DraftRecord]) -> list[DraftRecord]:
    for record in records:
        record.accepted = policy.alpha * record.judged
    return records


def _limits(policy: SpeculationPolicy, steps: int, batch_size: int, available: list[int],
            fixed: float, per_token: float) -> list[int]:
    """The largest draft limit of each of `steps` steps over a batch of sequences as good as the
    batch's alpha, each step observed at the cost fixed + per_token * n."""
    records = _aligned(policy, _veterans(batch_size))
    limits = []
    for _ in range(steps):
        step_limits = policy.draft_limits(records, available)
        limits.append(max(step_limits))
        n = batch_size + sum(min(limit, a) for limit, a in zip(step_limits, available))
        policy.observe_step(n, fixed + per_token * n, batch=batch_size)
    return limits


def test_the_cost_model_recovers_the_fixed_and_per_token_cost_of_a_step():
    fixed, per_token = _fitted(fixed=0.030, per_token=0.002, alpha=0.5).cost_model()
    assert fixed == pytest.approx(0.030)
    assert per_token == pytest.approx(0.002)


def test_extra_tokens_look_free_until_steps_of_different_sizes_are_seen():
    policy = SpeculationPolicy(TargetConfig())
    assert policy.draft_limits([DraftRecord()] * 16, [4] * 16) == [4] * 16
    for _ in range(50):
        policy.observe_step(16, 0.100, batch=16)
    assert policy.cost_model() == (pytest.approx(0.100), 0.0)


def test_the_cost_per_token_is_kept_while_the_steps_all_look_alike():
    """Steps of one size (no draft verified for a while) say nothing about what a token costs."""
    policy = _fitted(fixed=0.010, per_token=0.004, alpha=0.3)
    for _ in range(500):
        policy.observe_step(16, 0.010 + 0.004 * 16, batch=16)
    assert policy.cost_model() == (pytest.approx(0.010), pytest.approx(0.004))


def test_alpha_counts_the_drafts_judged_up_to_the_first_rejection():
    policy = SpeculationPolicy(TargetConfig())
    for _ in range(1000):
        policy.observe_verify(2, 4, record := DraftRecord())  # two accepted, the third rejected, the fourth never judged
    assert policy.alpha == pytest.approx(2 / 3)
    assert record.accepted / record.judged == pytest.approx(2 / 3)
    for _ in range(1000):
        policy.observe_verify(4, 4, record)
    assert policy.alpha == pytest.approx(1.0)
    assert record.accepted / record.judged == pytest.approx(1.0)


def test_at_batch_one_with_good_drafts_and_cheap_tokens_every_draft_is_verified():
    policy = _fitted(fixed=0.030, per_token=0.0005, alpha=0.7)
    limits = _limits(policy, 16, 1, [5], fixed=0.030, per_token=0.0005)
    assert sorted(limits) == [4] + [5] * 15  # one step explores one draft fewer
    assert set(_limits(policy, 16, 1, [3], fixed=0.030, per_token=0.0005)) <= {2, 3}  # never more than there are


def test_at_batch_sixteen_with_poor_drafts_and_costly_tokens_none_are_verified():
    policy = _fitted(fixed=0.010, per_token=0.004, alpha=0.3)
    limits = _limits(policy, 64, 16, [5] * 16, fixed=0.010, per_token=0.004)
    assert sorted(limits) == [0] * 63 + [1]  # one step explores a draft


def roofline(tokens: int) -> float:
    """An Ice Lake core's forward, SmolLM2 in blocks: a decode of one token streams every weight
    (10 ms); eight cost 17.6 ms, and each token past them 2.2 ms (bench.forward_speed)."""
    return max(0.010 + 0.0076 * (tokens - 1) / 7, 0.0176 + 0.0022 * (tokens - 8))


def test_drafts_are_priced_against_the_decode_measured_at_their_batch_size():
    """The step is no line: one fitted over decodes of 1 and 8 and verifies of 8 with 16 drafts
    prices a batch-8 decode above what it measured, and so each draft's share of the step below its
    own. Drafts accepted 8 times in 10 pay at batch 1 and not at batch 8, where each must add 0.9
    tokens (2 ms at 8 tokens per 17.6 ms)."""
    policy = speculation_policy(TargetConfig())
    for step in range(400):
        batch, tokens = ((1, 1), (8, 8), (8, 24))[step % 3]
        policy.observe_step(tokens, roofline(tokens), batch=batch)
    for i in range(400):
        policy.observe_verify(int(i % 10 < 8), 1, DraftRecord())
    fixed, per_token = policy.cost_model()
    assert fixed + 8 * per_token > 0.019 and per_token == pytest.approx(0.0020, abs=0.0003)  # the line
    assert policy.decode_seconds(8) == pytest.approx(0.0176) and policy.decode_seconds(1) == pytest.approx(0.010)
    at_eight = _aligned(policy, _veterans(8))
    assert policy.draft_limits(at_eight, [4] * 8) == [0] * 8
    [alone] = _aligned(policy, _veterans(1))
    assert policy.draft_limits([alone], [4]) >= [2]


def test_a_batch_sizes_decode_time_forgets_a_slow_first_step_and_lends_itself_to_its_neighbours():
    """Its first decodes are averaged plainly, so a cold first step fades with every decode after
    it; a batch size not yet measured takes the nearest measured one's, with the line's slope for
    the difference."""
    policy = speculation_policy(TargetConfig())
    for step in range(200):
        batch, tokens = ((1, 1), (1, 5))[step % 2]
        policy.observe_step(tokens, roofline(tokens), batch=batch)
    policy.observe_step(8, 0.100, batch=8)  # a cold first step
    for _ in range(99):
        policy.observe_step(8, roofline(8), batch=8)
    assert policy.decode_seconds(8) == pytest.approx(roofline(8), rel=0.05)  # a moving average from it: 0.029
    _, per_token = policy.cost_model()
    assert policy.decode_seconds(7) == pytest.approx(policy.decode_seconds(8) - per_token)
    assert policy.decode_seconds(2) == pytest.approx(policy.decode_seconds(1) + per_token)


def test_when_no_drafts_pay_one_step_in_sixty_four_still_verifies_one():
    policy = _fitted(fixed=0.010, per_token=0.004, alpha=0.3)
    limits = _limits(policy, 256, 16, [5] * 16, fixed=0.010, per_token=0.004)
    explored = [i for i, limit in enumerate(limits) if limit]
    assert [limits[i] for i in explored] == [1] * 4
    assert [b - a for a, b in zip(explored, explored[1:])] == [64] * 3
    assert set(_limits(policy, 64, 16, [0] * 16, fixed=0.010, per_token=0.004)) == {0}  # nothing to explore with


def test_a_batch_whose_steps_all_look_alike_still_learns_what_drafts_cost():
    policy = SpeculationPolicy(TargetConfig())  # extra tokens look free: every draft at first
    for i in range(400):
        policy.observe_verify(int(i % 10 < 3), 1, DraftRecord())
    limits = _limits(policy, 192, 16, [5] * 16, fixed=0.010, per_token=0.004)
    assert limits[0] == 5
    assert sorted(limits[-64:]) == [0] * 63 + [1]
    assert policy.cost_model() == (pytest.approx(0.010), pytest.approx(0.004))


def _rate_maximizing_limits(alphas: list[float], available: list[int], fixed: float, per_token: float) -> list[int]:
    """The definition: every draft ranked by worth alpha_i**j, and the first m of them for the m
    whose step has the most expected tokens per second."""
    worth = sorted(((alpha**j, i) for i, (alpha, most) in enumerate(zip(alphas, available))
                    for j in range(1, most + 1)), reverse=True)
    rates = [(len(alphas) + sum(w for w, _ in worth[:m])) / (fixed + per_token * (len(alphas) + m))
             for m in range(len(worth) + 1)]
    best = max(range(len(rates)), key=lambda m: (rates[m], -m))
    limits = [0] * len(alphas)
    for _, i in worth[:best]:
        limits[i] += 1
    return limits


def test_the_budgets_are_those_that_maximize_the_steps_expected_rate():
    rng = random.Random(7)
    for _ in range(500):
        batch = rng.randint(1, 40)
        policy = SpeculationPolicy(TargetConfig())
        fixed, per_token = rng.uniform(0.001, 0.05), rng.choice([0.0, rng.uniform(1e-6, 0.01)])
        policy.cost_model = lambda: (fixed, per_token)
        records = [DraftRecord(accepted=rng.uniform(0, 8), judged=8.0) for _ in range(batch)]
        available = [rng.randint(0, 8) for _ in range(batch)]
        alphas = [policy.sequence_alpha(record) for record in records]
        assert policy._best_limits(records, available) == _rate_maximizing_limits(alphas, available, fixed, per_token)


def test_synchronous_speculation_verifies_every_draft_whatever_it_costs():
    policy = _fitted(fixed=0.010, per_token=0.004, alpha=0.0, sync=True)
    assert _limits(policy, 16, 16, [5, 2] + [0] * 14, fixed=0.010, per_token=0.004) == [5] * 16


def _requests(policy: SpeculationPolicy, steps: int, batch_size: int, caps: list[int],
              fixed: float, per_token: float) -> list[tuple[int, int]]:
    """(the most drafts asked of the drafter after the step, the next step's largest draft limit) over
    `steps` steps of sequences as good as the batch's alpha, each verifying what it may of `caps`
    drafts and observed at the cost fixed + per_token * n."""
    records = _aligned(policy, _veterans(batch_size))
    pairs = []
    for _ in range(steps):
        requested = policy.drafts_to_request(records, caps)
        limits = policy.draft_limits(records, caps)
        pairs.append((max(requested), max(limits)))
        n = batch_size + sum(min(limit, c) for limit, c in zip(limits, caps))
        policy.observe_step(n, fixed + per_token * n, batch=batch_size)
    return pairs


def test_while_drafts_pay_the_drafter_is_asked_for_one_more_than_the_best_k_up_to_the_cap():
    policy = _fitted(fixed=0.030, per_token=0.0005, alpha=0.7)
    assert {requested for requested, _ in _requests(policy, 32, 1, [5], 0.030, 0.0005)} == {5}  # best is 5: the cap
    policy = _fitted(fixed=0.030, per_token=0.002, alpha=0.7)
    pairs = _requests(policy, 32, 4, [8] * 4, fixed=0.030, per_token=0.002)
    best = max(limit for _, limit in pairs)
    assert 0 < best < 7
    assert sorted(limit for _, limit in pairs) == [best - 1] * 2 + [best] * 30  # an exploring step: one fewer
    assert {requested for requested, _ in pairs} == {best + 1}


def test_while_no_drafts_pay_the_drafter_is_paused_but_for_the_steps_before_each_exploring_one():
    policy = _fitted(fixed=0.010, per_token=0.004, alpha=0.3)
    pairs = _requests(policy, 256, 16, [5] * 16, fixed=0.010, per_token=0.004)
    explored = [i for i, (_, limit) in enumerate(pairs) if limit]
    assert len(explored) == 4 and [pairs[i][1] for i in explored] == [1] * 4
    asked = [i for i, (requested, _) in enumerate(pairs) if requested]
    assert [pairs[i][0] for i in asked] == [1] * len(asked)
    # Asked after each of the three steps before an exploring step, and at no other time.
    assert asked == sorted(i - lead for i in explored for lead in (0, 1, 2) if i - lead >= 0)
    assert sum(requested for requested, _ in pairs) / len(pairs) < 0.05


def test_synchronous_speculation_always_asks_for_every_draft_it_can_verify():
    policy = _fitted(fixed=0.010, per_token=0.004, alpha=0.0, sync=True)
    assert {requested for requested, _ in _requests(policy, 16, 16, [5, 2] + [0] * 14, 0.010, 0.004)} == {5}


def test_a_paused_drafter_is_asked_again_once_the_exploring_steps_find_its_drafts_good():
    policy = _fitted(fixed=0.010, per_token=0.004, alpha=0.1)
    assert sorted(requested for requested, _ in _requests(policy, 64, 1, [4], 0.010, 0.004)) == [0] * 61 + [1] * 3
    resumed_after = None
    record = _aligned(policy, _veterans(1))[0]
    for step in range(64 * 40):
        [limit] = policy.draft_limits([record], [4])
        if limit:
            policy.observe_verify(limit, limit, record)  # the exploring step's draft is accepted
        policy.observe_step(1 + limit, 0.010 + 0.004 * (1 + limit), batch=1)
        if policy.drafts_to_request([record], [4]) >= [2]:
            resumed_after = step
            break
    assert resumed_after is not None and resumed_after > 64  # it took several exploring steps


def test_while_paused_the_exploring_step_waits_for_its_draft_and_no_other_step_does():
    policy = _fitted(fixed=0.010, per_token=0.004, alpha=0.3)
    for _ in range(200):
        policy.observe_draft_rtt(0.030)  # later than drafts are worth: no step waits for them
    bounds = []
    records = _aligned(policy, _veterans(16))
    for _ in range(128):
        policy.drafts_to_request(records, [5] * 16)  # sent with the Extends after each step
        bounds.append((max(policy.draft_limits(records, [5] * 16)), policy.wait_bound()))
        policy.observe_step(16 + bounds[-1][0] * 16, 0.010 + 0.004 * (16 + bounds[-1][0] * 16), batch=16)
    assert sorted(bounds) == [(0, 0.0)] * 126 + [(1, pytest.approx(0.050))] * 2  # --draft-wait-ms 50


def _rate(policy: SpeculationPolicy, alphas: list[float], limits: tuple[int, ...]) -> float:
    """Expected tokens per second of a step whose sequence i verifies limits[i] drafts."""
    fixed, per_token = policy.cost_model()
    expected = len(alphas) + sum(alpha**j for alpha, k in zip(alphas, limits) for j in range(1, k + 1))
    return expected / (fixed + per_token * (len(alphas) + sum(limits)))


def test_each_sequence_verifies_the_drafts_that_maximize_the_steps_rate_by_its_own_alpha():
    policy = _fitted(fixed=0.010, per_token=0.002, alpha=0.5)  # a step that explores nothing
    records = [DraftRecord(accepted=a * 32, judged=32.0) for a in (0.95, 0.8, 0.5, 0.1)]
    alphas = [policy.sequence_alpha(r) for r in records]
    available = [4, 3, 4, 2]
    limits = policy.draft_limits(records, available)
    best = max(itertools.product(*(range(a + 1) for a in available)), key=lambda ks: _rate(policy, alphas, ks))
    assert _rate(policy, alphas, tuple(limits)) == pytest.approx(_rate(policy, alphas, best))
    assert limits[0] > limits[2] and limits[3] == 0  # the better drafts, the more of them


def test_a_copying_sequence_keeps_speculating_in_a_batch_whose_drafts_do_not_pay():
    policy = _fitted(fixed=0.010, per_token=0.001, alpha=0.3)
    chats = _aligned(policy, _veterans(15))
    assert _limits(policy, 1, 15, [5] * 15, fixed=0.010, per_token=0.001) == [0]  # alone, no chat drafts pay
    copying = DraftRecord(accepted=31.0, judged=32.0)  # its drafts: 31 of 32 judged were accepted
    limits = policy.draft_limits([copying, *chats], [5] * 16)
    requested = policy.drafts_to_request([copying, *chats], [5] * 16)
    assert limits[0] >= 3 and limits[1:] == [0] * 15
    assert requested == [min(limits[0] + 1, 5)] + [0] * 15


def test_one_exploring_step_that_happens_to_be_fast_does_not_make_drafts_look_free():
    """At batch one, an exploring step adds one token, a lever as small as a step time's noise."""
    policy = _fitted(fixed=0.010, per_token=0.004, alpha=0.1)
    record = _aligned(policy, _veterans(1))[0]
    requested = []
    for _ in range(512):
        [limit] = policy.draft_limits([record], [4])
        policy.observe_step(1 + limit, 0.014, batch=1)  # the exploring step took no longer than a decode step
        requested += policy.drafts_to_request([record], [4])
    assert set(requested) == {0, 1} and sum(requested) <= 3 * 512 / 64


def test_a_paused_sequence_is_weighed_again_only_after_an_exploring_step():
    """Tokens turn cheap at once (a batch that left, say): the paused sequence resumes, but only
    once an exploring step has judged a draft of it, not at the first step whose time says so."""
    policy = _fitted(fixed=0.010, per_token=0.006, alpha=0.3)
    record = _aligned(policy, _veterans(1))[0]
    assert policy.drafts_to_request([record], [4]) == [0] and record.paused
    requested = []
    for _ in range(256):
        for n in (1, 3):  # steps of two sizes at the same cost: extra tokens are now free
            policy.observe_step(n, 0.010, batch=1)
        requested.append(policy.drafts_to_request([record], [4])[0])
        if requested[-1] > 1:
            break
    assert requested[-1] > 1, "never resumed"
    assert max(requested[:-1]) <= 1 and len(requested) > 32, "resumed before an exploring step"
    assert policy._steps_to_explore(64) == 63  # the step just taken was an exploring one
