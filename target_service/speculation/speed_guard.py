"""The speed guard: speculation only where it measurably makes a sequence faster than the target alone.

The policy's cost model predicts what drafts gain from the forward pass's cost. What a client sees
also pays for what the model does not see: waiting for drafts, handling proposals, and the drafter
itself, whose rounds share the machine's cores and memory bus with the target. So the guard
measures the rate the step loop realizes, tokens per second of wall time, with speculation and
without, and holds a sequence off wherever its speculation loses.

Measured, per step (a decode or verify step's whole cycle, waits and publishing included, prompts'
prefills excluded):
  - t_on(B), t_off(B): the seconds of a step of B sequences with speculation on (any sequence may
    verify drafts) and off (none may, and the drafter was asked for nothing);
  - m_i: sequence i's tokens per step while it speculates, drawn towards the recent sequences' mean
    while it has few steps of its own.
Speculating pays for sequence i while m_i / t_on(B) > 1 / t_off(B), that is m_i > c = t_on / t_off:
its speculation adds more tokens per step than the step's extra time is worth. Below c (1 - MARGIN)
the guard holds it off; above c (1 + MARGIN) it lets it speculate again.

c is measured from steps next to each other in time, not from two averages over different spans: a
step's time drifts with the machine (a shared host's speed moves by 15% within seconds) and with
the contexts (a long prompt's steps are slower), and off steps come only in windows, long apart.
So each exploring window's steps are compared with the last BEFORE_STEPS steps of the other kind
just before it, at the same batch size, and c is the running mean of those ratios.

Each kind of step needs measuring while the other is the rule, so exploring windows of
WINDOW_STEPS steps interrupt the rule: an off window (no sequence speculates) while some speculate,
an on window (every sequence may) while some are held off. A window comes at once when the batch
size at hand has no measurement of the kind it needs, and otherwise every EXPLORE_PERIOD steps;
an off window waits for the trials running (below), at most a trial's length, up
to four times rarer the further the measured speed-up is from 1, as they cost what the rule gains.
A new sequence speculates for its first TRIAL_STEPS measured steps, so that a request that copies
its prompt is found out at once; only SHORT_TRIAL_STEPS while the measured speed-up is far below 1
(SHORT_TRIAL_BELOW), where each trial step costs the client, and a copying request still shows
its tokens per step in two.
Steps after a change of mode are not measured: drafts asked for take a round trip to arrive, and a
drafter asked for none finishes its round first.
"""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass

WINDOW_STEPS = 8  # measured steps per exploring window
BEFORE_STEPS = 16  # steps of the rule before a window that its steps are compared with: the rule's steps
# vary more than a window's (waits, verifies of any length); the older they are, the more the machine drifted
MIN_BEFORE_STEPS = 4  # fewer of them within RECENT_STEPS make no ratio; a batch size's first window waits for them
RECENT_STEPS = 2 * BEFORE_STEPS  # how far back a step still counts as next to a window (or to an on step)
EXPLORE_PERIOD = 64  # steps between exploring windows near break-even
MAX_PERIOD_FACTOR = 4  # windows up to this many times rarer when the speed-up is clearly above or below 1
CONFIDENT_LOG_RATIO = 0.05  # |log speed-up| per factor of the period
TRIAL_STEPS = 8  # measured speculating steps a new sequence has before its own rate may hold it off
SHORT_TRIAL_STEPS = 2  # the trial while the measured speed-up is below SHORT_TRIAL_BELOW
SHORT_TRIAL_BELOW = 0.8
MARGIN = 0.02  # hysteresis around break-even
PRIOR_STEPS = 4.0  # a sequence's tokens per step start as the recent sequences', worth this many steps
MAX_LEAD = 8  # steps ahead that drafts are asked for before an on window, at most
_SETTLE_STEPS = 2  # steps of a mode before its steps are measured: drafts asked take a step to come
_SMOOTHING = 0.05  # weight of the newest step in the step-time averages and the prior
_RATIO_SMOOTHING = 0.25  # weight of the newest window's ratio in c: about the last four windows
_SEQUENCE_KEEP = 1 - 1 / 32  # a sequence's own tokens per step weigh its last ~32 speculating steps


class _Average:
    """The mean of the first 1 / smoothing samples, then an exponentially weighted one: a few
    samples weigh alike, and old ones fade."""

    __slots__ = ("value", "count", "smoothing")

    def __init__(self, smoothing: float = _SMOOTHING) -> None:
        self.value, self.count, self.smoothing = 0.0, 0, smoothing

    def add(self, x: float) -> None:
        self.count += 1
        self.value += max(self.smoothing, 1 / self.count) * (x - self.value)


@dataclass(slots=True)
class GuardRecord:
    """One sequence's realized speculation: its tokens per speculating step, and the guard's verdict."""

    tokens: float = 0.0  # decayed sums over measured steps in which it could speculate
    steps: float = 0.0
    measured: int = 0  # such steps, undecayed, for its trial
    held_off: bool = False  # its speculation was measured to lose: it decodes as the target alone would
    trial: bool = True  # it may speculate until it has trial_steps measured steps
    trial_steps: int = TRIAL_STEPS
    last_on: bool = False  # it could speculate in the last step

    def add(self, tokens: int) -> None:
        self.tokens = _SEQUENCE_KEEP * self.tokens + tokens
        self.steps = _SEQUENCE_KEEP * self.steps + 1
        self.measured += 1


@dataclass(frozen=True, slots=True)
class StepResult:
    """What one decode or verify step realized, for the guard."""

    records: list[GuardRecord]
    speculating: list[bool]  # whether each sequence could verify drafts (the guard allowed it and it had a cap)
    tokens: list[int]  # tokens each committed
    seconds: float  # the step's whole cycle


@dataclass(slots=True)
class _Window:
    on: bool  # an on window (every sequence may speculate) or an off window (none may)
    start: int  # its first step, after the lead
    end: int  # one past its last step
    lead: int  # steps before start in which drafts are asked for ahead of the window

    def leading(self, step: int) -> bool:
        """The step runs while drafts are asked for ahead of the window: neither mode's steady state."""
        return self.start - self.lead <= step < self.start


@dataclass(slots=True)
class GuardFigures:
    """What the guard measured, for metrics: tokens gained and lost against the target alone."""

    gained: float = 0.0
    lost: float = 0.0
    holds: int = 0  # sequences held off
    releases: int = 0  # sequences let speculate again
    on_windows: int = 0
    off_windows: int = 0


class SpeedGuard:
    def __init__(self) -> None:
        self._step = 0  # steps observed
        # on/off -> batch size -> the last steps: (the step, its seconds)
        self._recent: dict[bool, dict[int, deque[tuple[int, float]]]] = {True: {}, False: {}}
        self._ratios: dict[int, _Average] = {}  # batch size -> t_on / t_off, from windows and the steps before them
        self._prior = _Average()  # tokens per speculating step, over recent sequences' steps
        self._speedup = _Average()  # realized tokens per step / tokens the target alone would have made
        self._window: _Window | None = None
        self._next_window = EXPLORE_PERIOD
        self._last_kind = False  # the kind of the last window, to alternate in mixed batches
        self._modes: list[bool] = []  # the batch's mode (on/off) in recent steps, newest last
        self._due_since: int | None = None  # the step an off window fell due while a trial ran
        self.figures = GuardFigures()

    # ---- what the steps may do ------------------------------------------------------------------

    def allowed(self, records: list[GuardRecord]) -> list[bool]:
        """Whether each sequence may verify drafts in the next step."""
        return [self._on_at(record, self._step) for record in records]

    def wanted(self, records: list[GuardRecord], caps: list[int], lead: int) -> list[bool]:
        """Whether each sequence should now ask the drafter for drafts, which take about `lead` steps
        to arrive: it may speculate in the next step, or an on window starts within `lead` steps.
        caps: the drafts each could verify; windows are planned for those that could verify any."""
        lead = min(lead, MAX_LEAD)
        self._plan_window([record for record, cap in zip(records, caps, strict=True) if cap > 0], lead)
        window, step = self._window, self._step
        early = window is not None and window.on and window.start - lead <= step < window.end
        return [early or self._on_at(record, step) for record in records]

    def new_record(self) -> GuardRecord:
        """A new sequence's record, on trial: a short one while speculation has lately lost far too much."""
        losing = self._speedup.count >= TRIAL_STEPS and self._speedup.value < SHORT_TRIAL_BELOW
        return GuardRecord(trial_steps=SHORT_TRIAL_STEPS if losing else TRIAL_STEPS)

    def new_drafter(self, records: list[GuardRecord]) -> None:
        """A drafter (re)connected: what speculating cost with the last one says nothing of this one.
        Its measurements are forgotten, and the running sequences get a trial again, which no window
        overdue from the time without a drafter interrupts: the first window, which measures c afresh,
        comes once the trials end. Its first steps settle before they are measured, as after any
        change of mode."""
        self._recent[True].clear()
        self._ratios.clear()
        self._window, self._next_window = None, self._step + EXPLORE_PERIOD
        self._prior, self._speedup = _Average(), _Average()
        self._modes = []
        for record in records:
            record.last_on = False
            record.tokens = record.steps = 0.0
            record.measured, record.held_off, record.trial, record.trial_steps = 0, False, True, TRIAL_STEPS

    @property
    def speedup(self) -> float | None:
        """The realized speed-up of the steps that could speculate, against the target alone; None until measured."""
        return self._speedup.value if self._speedup.count else None

    def _on_at(self, record: GuardRecord, step: int) -> bool:
        window = self._window
        if window is not None and window.start <= step < window.end:
            return window.on
        return record.trial or not record.held_off

    def _plan_window(self, records: list[GuardRecord], lead: int) -> None:
        """Schedule the next exploring window once the period is up: off while any sequence
        speculates and on while any is held off, alternating when both. An on window starts after
        `lead` steps, so that its first steps find the drafts they asked for."""
        if self._window is not None and self._step >= self._window.end:
            self._add_ratios(self._window)
            self._window = None
            self._next_window = self._step + self._period()
        if self._window is not None:
            return
        speculating = any(r.trial or not r.held_off for r in records)
        held = any(r.held_off and not r.trial for r in records)
        batch = len(records)
        unmeasured_off = speculating and self._unmeasured(batch, before=True)
        unmeasured_on = held and self._unmeasured(batch, before=False)
        if not (unmeasured_off or unmeasured_on) and (self._step < self._next_window or not (speculating or held)):
            self._due_since = None
            return
        on = unmeasured_on or (held and not unmeasured_off and (not speculating or not self._last_kind))
        if not on and self._trial_running(records):
            return
        self._due_since = None
        start = self._step + (lead if on else 0)
        self._window = _Window(on, start, start + WINDOW_STEPS, lead if on else 0)
        self._last_kind = on
        if on:
            self.figures.on_windows += 1
        else:
            self.figures.off_windows += 1

    def _unmeasured(self, batch: int, before: bool) -> bool:
        """No c at this batch size yet, and enough steps of the kind `before` (the rule) to compare a
        window with: without them the window would measure nothing, and the next come at once, for good."""
        return self.cost_ratio(batch) is None and len(self._recent_times(before, batch, self._step)) >= MIN_BEFORE_STEPS

    def _trial_running(self, records: list[GuardRecord]) -> bool:
        """A sequence is on its trial, which an off window would interrupt (a request that copies its
        prompt copies in its first steps): the window waits, at most a trial's length (its measured
        steps and the two settling steps before them) from when it fell due."""
        if not any(r.trial for r in records):
            return False
        if self._due_since is None:
            self._due_since = self._step
        return self._step - self._due_since < TRIAL_STEPS + _SETTLE_STEPS

    def _period(self) -> int:
        if not self._speedup.count:
            return EXPLORE_PERIOD
        distance = abs(math.log(max(self._speedup.value, 1e-3)))
        return EXPLORE_PERIOD * int(min(MAX_PERIOD_FACTOR, max(1.0, distance / CONFIDENT_LOG_RATIO)))

    # ---- what they did ---------------------------------------------------------------------------

    def skip(self) -> None:
        """A step in which no sequence could speculate (the drafter away, or none asking), which the
        guard does not time: an off step all the same for the settling of the steps after it."""
        self._modes = [*self._modes[1 - _SETTLE_STEPS:], False]

    def observe(self, step: StepResult) -> None:
        """A step's realized cycle; steps right after a change of mode are not measured."""
        on = any(step.speculating)
        settled = len(self._modes) >= _SETTLE_STEPS and all(mode == on for mode in self._modes)
        settled &= self._window is None or not self._window.leading(self._step)
        self._modes = [*self._modes[1 - _SETTLE_STEPS:], on]
        self._step += 1
        if settled and step.seconds > 0:
            batch = len(step.records)
            self._recent[on].setdefault(batch, deque(maxlen=BEFORE_STEPS)).append((self._step - 1, step.seconds))
            if on:
                self._observe_on(step, batch)
        for record, speculating in zip(step.records, step.speculating, strict=True):
            record.last_on = speculating

    def _observe_on(self, step: StepResult, batch: int) -> None:
        cost = self.cost_ratio(batch)
        if cost is not None:
            # tokens the target alone would have made in this time: the recent on steps' time over c
            # is what an off step takes now
            on = _mean(self._recent_times(True, batch, self._step))
            alone = step.seconds * batch * cost / on
            made = sum(step.tokens)
            self._speedup.add(made / alone)
            if made >= alone:
                self.figures.gained += made - alone
            else:
                self.figures.lost += alone - made
        for record, speculating, tokens in zip(step.records, step.speculating, step.tokens, strict=True):
            if not (speculating and record.last_on):
                continue
            record.add(tokens)
            self._prior.add(tokens)
            if record.trial and record.measured >= record.trial_steps:
                record.trial = False
            if cost is not None:
                self._judge(record, cost)

    def _judge(self, record: GuardRecord, cost: float) -> None:
        prior = self._prior.value if self._prior.count else 1.0
        rate = (record.tokens + PRIOR_STEPS * prior) / (record.steps + PRIOR_STEPS)
        if not record.held_off and rate < cost * (1 - MARGIN):
            record.held_off = True
            self.figures.holds += 1
        elif record.held_off and rate > cost * (1 + MARGIN):
            record.held_off = False
            self.figures.releases += 1

    def cost_ratio(self, batch: int) -> float | None:
        """t_on / t_off for a batch of this size (or the closest measured); None until a window has
        measured it."""
        near = [b for b in self._ratios if abs(b - batch) <= max(1, batch // 4)]  # within a quarter, at least one
        return self._ratios[min(near, key=lambda b: (abs(b - batch), b))].value if near else None

    def _add_ratios(self, window: _Window) -> None:
        """A window ended: its steps against the other kind's just before it, at each batch size it
        measured. Steps next to each other in time see the same machine and about the same contexts."""
        for batch, steps in self._recent[window.on].items():
            times = [seconds for step, seconds in steps if window.start <= step < window.end]
            before = self._recent_times(not window.on, batch, window.start - window.lead)
            if times and len(before) >= MIN_BEFORE_STEPS:
                on, off = (times, before) if window.on else (before, times)
                self._ratios.setdefault(batch, _Average(_RATIO_SMOOTHING)).add(_mean(on) / _mean(off))

    def _recent_times(self, on: bool, batch: int, until: int) -> list[float]:
        """The seconds of the last steps of this kind at this batch size, of those within RECENT_STEPS
        before step `until`: in a mixed batch an on window's rule is on, and the off steps at hand are
        the last off window's, long before."""
        return [seconds for step, seconds in self._recent[on].get(batch, ()) if until - RECENT_STEPS <= step]


def _mean(values: Collection[float]) -> float:
    return sum(values) / len(values)
