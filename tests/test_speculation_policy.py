"""The draft-wait bound: as long as drafts are worth, and nothing when they come too late to be.
The draft budget: as many drafts per sequence as the step's expected tokens per second reward."""
from __future__ import annotations

import pytest

from target_service.config import TargetConfig
from target_service.speculation import SpeculationPolicy, speculation_policy


def _policy(draft_wait_ms: float, sync: bool = False) -> SpeculationPolicy:
    policy = speculation_policy(TargetConfig(draft_wait_ms=draft_wait_ms, sync_speculation=sync))
    for _ in range(200):  # long enough for the moving averages to settle
        policy.observe_step(1, 0.040)
        policy.observe_verify(2, 4)
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
    assert policy.wait_bound() == pytest.approx(0.030)


def test_rejected_drafts_shrink_the_bound():
    policy = _policy(draft_wait_ms=500)
    for _ in range(200):
        policy.observe_verify(0, 4)
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
    assert policy.wait_deadline(10.0) == pytest.approx(10.030)
    policy.observe_update_sent(10.0)
    policy.observe_update_sent(10.020)  # the first unanswered update sets the clock
    assert policy.wait_deadline(10.020) == pytest.approx(10.030)
    assert policy.wait_deadline(10.100) < 10.100  # silent past its patience: no wait at all
    policy.observe_answer()
    assert policy.wait_deadline(10.100) == pytest.approx(10.130)


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
        policy.observe_step(n, fixed + per_token * n)
    for i in range(400):
        policy.observe_verify(int(i % 10 < alpha * 10), 1)
    assert policy.alpha == pytest.approx(alpha, abs=0.05)
    return policy


def _limits(policy: SpeculationPolicy, steps: int, batch_size: int, available: list[int],
            fixed: float, per_token: float) -> list[int]:
    """The draft limit of each of `steps` steps, each observed at the cost fixed + per_token * n."""
    limits = []
    for _ in range(steps):
        limits.append(policy.draft_limit(batch_size, available))
        n = batch_size + sum(min(limits[-1], a) for a in available)
        policy.observe_step(n, fixed + per_token * n)
    return limits


def test_the_cost_model_recovers_the_fixed_and_per_token_cost_of_a_step():
    fixed, per_token = _fitted(fixed=0.030, per_token=0.002, alpha=0.5).cost_model()
    assert fixed == pytest.approx(0.030)
    assert per_token == pytest.approx(0.002)


def test_extra_tokens_look_free_until_steps_of_different_sizes_are_seen():
    policy = SpeculationPolicy(TargetConfig())
    assert policy.draft_limit(16, [4] * 16) == 4
    for _ in range(50):
        policy.observe_step(16, 0.100)
    assert policy.cost_model() == (pytest.approx(0.100), 0.0)


def test_the_cost_per_token_is_kept_while_the_steps_all_look_alike():
    """Steps of one size (no draft verified for a while) say nothing about what a token costs."""
    policy = _fitted(fixed=0.010, per_token=0.004, alpha=0.3)
    for _ in range(500):
        policy.observe_step(16, 0.010 + 0.004 * 16)
    assert policy.cost_model() == (pytest.approx(0.010), pytest.approx(0.004))


def test_alpha_counts_the_drafts_judged_up_to_the_first_rejection():
    policy = SpeculationPolicy(TargetConfig())
    for _ in range(1000):
        policy.observe_verify(2, 4)  # two accepted, the third rejected, the fourth never judged
    assert policy.alpha == pytest.approx(2 / 3)
    for _ in range(1000):
        policy.observe_verify(4, 4)
    assert policy.alpha == pytest.approx(1.0)


def test_at_batch_one_with_good_drafts_and_cheap_tokens_every_draft_is_verified():
    policy = _fitted(fixed=0.030, per_token=0.0005, alpha=0.7)
    limits = _limits(policy, 16, 1, [5], fixed=0.030, per_token=0.0005)
    assert sorted(limits) == [4] + [5] * 15  # one step explores one draft fewer
    assert set(_limits(policy, 16, 1, [3], fixed=0.030, per_token=0.0005)) <= {2, 3}  # never more than there are


def test_at_batch_sixteen_with_poor_drafts_and_costly_tokens_none_are_verified():
    policy = _fitted(fixed=0.010, per_token=0.004, alpha=0.3)
    limits = _limits(policy, 64, 16, [5] * 16, fixed=0.010, per_token=0.004)
    assert sorted(limits) == [0] * 63 + [1]  # one step explores a draft


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
        policy.observe_verify(int(i % 10 < 3), 1)
    limits = _limits(policy, 192, 16, [5] * 16, fixed=0.010, per_token=0.004)
    assert limits[0] == 5
    assert sorted(limits[-64:]) == [0] * 63 + [1]
    assert policy.cost_model() == (pytest.approx(0.010), pytest.approx(0.004))


def test_synchronous_speculation_verifies_every_draft_whatever_it_costs():
    policy = _fitted(fixed=0.010, per_token=0.004, alpha=0.0, sync=True)
    assert _limits(policy, 16, 16, [5, 2] + [0] * 14, fixed=0.010, per_token=0.004) == [5] * 16


def _requests(policy: SpeculationPolicy, steps: int, batch_size: int, caps: list[int],
              fixed: float, per_token: float) -> list[tuple[int, int]]:
    """(drafts asked of the drafter after the step, the next step's draft limit) over `steps` steps,
    each verifying what it may of `caps` drafts and observed at the cost fixed + per_token * n."""
    pairs = []
    for _ in range(steps):
        requested = policy.drafts_to_request(batch_size, caps)
        limit = policy.draft_limit(batch_size, caps)
        pairs.append((requested, limit))
        n = batch_size + sum(min(limit, c) for c in caps)
        policy.observe_step(n, fixed + per_token * n)
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
    for step in range(64 * 40):
        limit = policy.draft_limit(1, [4])
        if limit:
            policy.observe_verify(limit, limit)  # the exploring step's draft is accepted
        policy.observe_step(1 + limit, 0.010 + 0.004 * (1 + limit))
        if policy.drafts_to_request(1, [4]) >= 2:
            resumed_after = step
            break
    assert resumed_after is not None and resumed_after > 64  # it took several exploring steps


def test_while_paused_the_exploring_step_waits_for_its_draft_and_no_other_step_does():
    policy = _fitted(fixed=0.010, per_token=0.004, alpha=0.3)
    for _ in range(200):
        policy.observe_draft_rtt(0.030)  # later than drafts are worth: no step waits for them
    bounds = []
    for _ in range(128):
        policy.drafts_to_request(16, [5] * 16)  # sent with the Extends after each step
        bounds.append((policy.draft_limit(16, [5] * 16), policy.wait_bound()))
        policy.observe_step(16 + bounds[-1][0] * 16, 0.010 + 0.004 * (16 + bounds[-1][0] * 16))
    assert sorted(bounds) == [(0, 0.0)] * 126 + [(1, pytest.approx(0.050))] * 2  # --draft-wait-ms 50
