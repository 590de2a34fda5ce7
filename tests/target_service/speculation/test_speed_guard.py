"""The speed guard on scripted steps with a fake clock: what each step takes and makes is given, so
every decision follows from measured rates, never from this machine's speed."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest

from target_service.config import TargetConfig
from target_service.speculation.policy import SpeculationPolicy
from target_service.speculation.speed_guard import (
    EXPLORE_PERIOD, MAX_PERIOD_FACTOR, SHORT_TRIAL_BELOW, SHORT_TRIAL_STEPS, TRIAL_STEPS, WINDOW_STEPS, GuardRecord,
    SpeedGuard, StepResult,
)

DECODE = 0.020  # seconds of a step in which no sequence speculates


@dataclass
class Behaviour:
    """What a sequence does when it speculates: tokens per step, and the seconds it adds to the step."""

    tokens: int
    extra: float


@dataclass
class Trace:
    allowed: list[list[bool]]
    wanted: list[list[bool]]


def run(guard: SpeedGuard, records: list[GuardRecord], behaviours: list[Behaviour], steps: int,
        lead: int = 1, pace: Callable[[int], float] = lambda step: 1.0) -> Trace:
    """Each step: the guard says who may speculate; those make their tokens and add their time.
    pace(step): how much slower than usual the machine runs that step (the same for either kind)."""
    trace = Trace([], [])
    for step in range(steps):
        allowed = guard.allowed(records)
        tokens = [b.tokens if ok else 1 for b, ok in zip(behaviours, allowed)]
        seconds = pace(step) * (DECODE + sum(b.extra for b, ok in zip(behaviours, allowed) if ok))
        guard.observe(StepResult(records, allowed, tokens, seconds))
        trace.allowed.append(allowed)
        trace.wanted.append(guard.wanted(records, [4] * len(records), lead))
    return trace


LOSES = Behaviour(tokens=1, extra=0.004)  # drafts rarely accepted, and the drafter slows the step
PAYS = Behaviour(tokens=2, extra=0.008)  # a copying request: two tokens a step for 1.4 steps' time


def test_a_sequence_whose_speculation_loses_is_held_off_and_stays_off():
    guard = SpeedGuard()
    record = GuardRecord()
    trace = run(guard, [record], [LOSES], 4 * EXPLORE_PERIOD)
    assert record.held_off and not record.trial
    last = [ok for [ok] in trace.allowed[-EXPLORE_PERIOD:]]
    # Off but for the exploring windows: at most one window's worth of speculating steps per period.
    assert sum(last) <= WINDOW_STEPS
    assert guard.figures.holds == 1 and guard.figures.releases == 0
    assert guard.speedup is not None and guard.speedup < 1
    assert guard.figures.lost > guard.figures.gained


def test_a_sequence_whose_speculation_pays_keeps_it_but_for_off_windows():
    guard = SpeedGuard()
    record = GuardRecord()
    longest = EXPLORE_PERIOD * MAX_PERIOD_FACTOR
    trace = run(guard, [record], [PAYS], 6 * longest)
    assert not record.held_off
    assert guard.speedup is not None and guard.speedup > 1.3
    # The windows grow rarer as the speed-up is clearly above 1, down to one per EXPLORE_PERIOD * MAX_PERIOD_FACTOR.
    last = [ok for [ok] in trace.allowed[-2 * longest:]]
    assert sum(not ok for ok in last) == 2 * WINDOW_STEPS


def test_an_on_window_lets_a_held_sequence_speculate_again_once_it_pays():
    guard = SpeedGuard()
    record = GuardRecord()
    run(guard, [record], [LOSES], 3 * EXPLORE_PERIOD)
    assert record.held_off
    # The same request now copies its prompt: the next on windows measure that.
    run(guard, [record], [PAYS], 2 * EXPLORE_PERIOD * MAX_PERIOD_FACTOR)
    assert not record.held_off
    assert guard.figures.releases >= 1


def test_drafts_are_asked_for_the_lead_before_an_on_window():
    guard = SpeedGuard()
    record = GuardRecord()
    lead = 3
    trace = run(guard, [record], [LOSES], 3 * EXPLORE_PERIOD * MAX_PERIOD_FACTOR, lead=lead)
    allowed = [ok for [ok] in trace.allowed]
    wanted = [ok for [ok] in trace.wanted]
    late = range(2 * EXPLORE_PERIOD, len(allowed))
    starts = [i for i in late if allowed[i] and not allowed[i - 1]]
    assert starts, "no on window after the sequence was held off"
    for start in starts:
        # wanted[i] is asked after step i, for the steps after it: from `lead` steps before the window.
        assert all(wanted[start - 1 - ahead] for ahead in range(lead))
        assert not wanted[start - 1 - lead - 1]


def test_no_step_right_after_a_change_of_mode_is_measured():
    """A step whose drafts were asked for a step earlier is not yet what speculating costs."""
    guard = SpeedGuard()
    record = GuardRecord()
    for on, seconds in ((True, 0.5), (False, 0.9), (True, 0.7), (True, 0.03), (True, 0.03), (True, 0.03)):
        guard.observe(StepResult([record], [on], [2 if on else 1], seconds))
    assert guard.cost_ratio(1) is None  # no settled off step yet
    assert record.measured == 2  # the last two on steps, each after two on steps


def test_the_first_steps_after_a_skipped_one_or_a_new_drafter_are_not_measured():
    """A step in which no sequence could speculate is not timed, but it is an off step: the on steps
    after it (their drafts asked for then) settle first, as do a new drafter's first steps."""
    guard = SpeedGuard()
    record = GuardRecord()
    for _ in range(3):
        guard.observe(StepResult([record], [True], [2], 0.03))
    measured = record.measured
    guard.skip()
    for seconds in (0.5, 0.7):
        guard.observe(StepResult([record], [True], [1], seconds))
    assert record.measured == measured  # the two steps after the skipped one settle
    guard.new_drafter([record])
    guard.observe(StepResult([record], [True], [1], 0.9))
    assert record.measured == 0 and guard.speedup is None


AWFUL = Behaviour(tokens=1, extra=0.020)  # speculating doubles the step and adds nothing


def test_while_speculation_loses_far_too_much_a_new_chat_gets_only_a_short_trial():
    guard = SpeedGuard()
    # The first sequence's trial runs whole, then the off window: its on windows measure the loss.
    run(guard, [GuardRecord()], [AWFUL], 6 * EXPLORE_PERIOD)
    assert guard.speedup < SHORT_TRIAL_BELOW
    newcomer = guard.new_record()
    assert newcomer.trial_steps == SHORT_TRIAL_STEPS < TRIAL_STEPS
    trace = run(guard, [newcomer], [AWFUL], TRIAL_STEPS + 4)
    assert newcomer.held_off and not newcomer.trial
    # Measured steps come after two settled ones: the trial costs a few steps, not TRIAL_STEPS.
    assert sum(ok for [ok] in trace.allowed) <= SHORT_TRIAL_STEPS + 2


def test_while_speculation_loses_far_too_much_a_new_copying_request_is_still_found_out():
    guard = SpeedGuard()
    run(guard, [GuardRecord()], [AWFUL], 3 * EXPLORE_PERIOD)
    newcomer = guard.new_record()
    copying = Behaviour(tokens=4, extra=0.020)  # a verify that twice a decode's time makes four tokens
    trace = run(guard, [newcomer], [copying], 4 * TRIAL_STEPS)
    assert not newcomer.held_off and not newcomer.trial
    assert all(ok for [ok] in trace.allowed[-TRIAL_STEPS:])


def test_a_new_sequence_gets_a_trial_where_speculation_pays_off_or_is_close():
    guard = SpeedGuard()
    run(guard, [GuardRecord()], [LOSES], 3 * EXPLORE_PERIOD)
    assert guard.speedup > SHORT_TRIAL_BELOW
    newcomer = guard.new_record()
    assert newcomer.trial and newcomer.trial_steps == TRIAL_STEPS and not newcomer.held_off
    trace = run(guard, [newcomer], [PAYS], TRIAL_STEPS + 4)
    assert all(ok for [ok] in trace.allowed[:TRIAL_STEPS])


def test_in_a_batch_the_copying_request_speculates_while_the_chats_are_held_off():
    guard = SpeedGuard()
    chats = [GuardRecord() for _ in range(3)]
    copying = GuardRecord()
    chat = Behaviour(tokens=1, extra=0.003)
    copy = Behaviour(tokens=3, extra=0.004)
    run(guard, [*chats, copying], [chat, chat, chat, copy], 6 * EXPLORE_PERIOD)
    assert all(record.held_off for record in chats)
    assert not copying.held_off


def test_step_times_are_compared_at_the_same_batch_size():
    guard = SpeedGuard()
    one, eight = GuardRecord(), [GuardRecord() for _ in range(8)]
    run(guard, [one], [PAYS], 2 * EXPLORE_PERIOD)
    assert guard.cost_ratio(1) == pytest.approx(1.4)
    for _ in range(WINDOW_STEPS):
        guard.observe(StepResult(eight, [True] * 8, [1] * 8, 0.08))
    assert guard.cost_ratio(8) is None  # 1's steps say nothing of 8's, and 8 has no window yet


def test_a_new_drafter_is_measured_afresh_and_every_running_sequence_gets_a_trial():
    """An outage's steps (waits for a drafter that never answered) say nothing of the drafter that comes back."""
    guard = SpeedGuard()
    record = GuardRecord()
    run(guard, [record], [Behaviour(tokens=1, extra=0.050)], 3 * EXPLORE_PERIOD)
    assert record.held_off and guard.speedup < SHORT_TRIAL_BELOW
    guard.new_drafter([record])
    assert guard.speedup is None and record.trial and not record.held_off
    assert guard.new_record().trial_steps == TRIAL_STEPS
    trace = run(guard, [record], [PAYS], TRIAL_STEPS + 2)
    assert all(ok for [ok] in trace.allowed[:TRIAL_STEPS])


def test_an_off_window_leaves_the_cost_models_own_verdict_alone():
    """The drafter is asked for nothing during an off window; afterwards a sequence whose drafts the
    cost model judges worth verifying is asked for them again (its pause is the model's, not the guard's)."""
    policy = SpeculationPolicy(TargetConfig())
    record = policy.new_record()
    asked = [policy.drafts_to_request([record], [4])[0]]
    for _ in range(TRIAL_STEPS + 2 * WINDOW_STEPS):
        [limit] = policy.draft_limits([record], [4])
        policy.observe_step(1 + limit, DECODE, batch=1)
        speculating = policy.allowed([record])[0] and asked[-1] > 0
        policy.observe_cycle([record], [speculating], [1 + limit], DECODE)
        asked.append(policy.drafts_to_request([record], [4])[0])
    assert policy.guard.figures.off_windows == 1
    assert asked[0] > 0 and 0 in asked  # asked, then not during the off window
    assert asked[-1] > 0 and not record.paused


def test_an_off_window_waits_for_a_new_sequences_trial():
    """A request that copies its prompt copies in its first steps: an off window for a batch size
    not yet measured comes after its trial, not at its first step."""
    guard = SpeedGuard()
    record = GuardRecord()
    trace = run(guard, [record], [PAYS], 4 * TRIAL_STEPS)
    allowed = [ok for [ok] in trace.allowed]
    first_off = allowed.index(False)
    assert all(allowed[:first_off]) and first_off >= TRIAL_STEPS + 2, f"an off window at step {first_off}"
    assert not all(allowed), "the off window came once the trial was done"


SLIGHT_LOSS = Behaviour(tokens=1, extra=0.002)  # speculating adds a tenth to the step and no token
SLIGHT_GAIN = Behaviour(tokens=3, extra=0.036)  # three tokens for 2.8 steps' time


def test_a_machine_that_speeds_up_does_not_pass_for_a_gain():
    """The steps get faster all along (a shared host's load falls, the long prompts' sequences give
    way to short chats): off steps measured in a window long ago were slower than any step now.
    Compared with those, speculation that loses a tenth would look like a gain."""
    guard = SpeedGuard()
    record = GuardRecord()
    steps = 12 * EXPLORE_PERIOD
    run(guard, [record], [SLIGHT_LOSS], steps, pace=lambda step: 2.0 - step / steps)
    assert record.held_off
    assert guard.cost_ratio(1) == pytest.approx(1.1, rel=0.02)


def test_a_machine_that_slows_down_does_not_pass_for_a_loss():
    guard = SpeedGuard()
    record = GuardRecord()
    steps = 12 * EXPLORE_PERIOD
    run(guard, [record], [SLIGHT_GAIN], steps, pace=lambda step: 1.0 + step / steps)
    assert not record.held_off and guard.figures.holds == 0
    assert guard.cost_ratio(1) == pytest.approx(2.8, rel=0.02)


def test_a_batch_size_first_seen_right_after_a_change_of_mode_still_speculates():
    """Its first steps are not measured, so a window at once would have no steps of the rule before it
    to compare with: it would measure nothing, and the next would come at once, window after window."""
    guard = SpeedGuard()
    records = [GuardRecord() for _ in range(8)]
    pays_in_a_batch = Behaviour(tokens=3, extra=0.002)
    run(guard, records, [pays_in_a_batch] * 8, 4 * EXPLORE_PERIOD)
    guard.observe(StepResult(records, [False] * 8, [1] * 8, DECODE))  # a step without speculation
    trace = run(guard, records[:4], [pays_in_a_batch] * 4, 2 * EXPLORE_PERIOD)  # half of them finished
    assert guard.cost_ratio(4) == pytest.approx(1.4, rel=0.02)
    assert sum(all(allowed) for allowed in trace.allowed) > 1.5 * EXPLORE_PERIOD
