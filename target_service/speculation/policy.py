"""How long a step may wait for drafts, and how many it verifies: only as many as pay for themselves.

SyncPolicy is the blocking baseline that benchmarks compare against (--sync-speculation)."""
from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from target_service.config import TargetConfig
from target_service.speculation.speed_guard import GuardRecord, SpeedGuard, StepResult

_SMOOTHING = 0.1  # weight of the newest observation in the moving averages
_MODEL_SMOOTHING = 0.02  # the same for the step-cost fit and alpha: slower, as they steer every step
_MIN_SPREAD = 0.01  # tokens^2: below this variance of step sizes the cost slope would be noise
_MIN_SECONDS = 1e-6  # keeps the fitted step time positive
_EXPLORE_EVERY = 16  # while drafts pay, one step in this many verifies one draft fewer than the best
_EXPLORE_PAUSED_EVERY = 64  # while none pay, one step in this many verifies one, to notice when they would
_EXPLORE_LEAD = 3  # while none pay, the drafter drafts only for this many steps before each exploring one
_SYNC_WAIT = 1.0  # synchronous speculation waits this long at most, so that a dead drafter can't stall us
_PATIENCE_RTTS = 4  # a drafter that answers nothing for this many of its round trips is taken as hung
_PRIOR_JUDGED = 4.0  # a sequence's own alpha starts as the batch's, worth this many judged drafts
_PRIOR_ANSWERS = 4.0  # a sequence's share of answers with drafts starts as the batch's, worth this many answers
_SEQUENCE_SMOOTHING = 1 / 16  # weight of a sequence's newest verification in its own record
_DELAY_SAMPLES = 64  # the drafter's latest answer delays, from which a step decides how long to wait
_WAIT_SLACK, _WAIT_SLACK_SECONDS = 0.1, 0.0005  # a wait outlasts the round trip it waits for by this much


def _judged(num_accepted: int, num_drafts: int) -> int:
    """Drafts are judged in order up to the first rejection: the drafts after it say nothing
    about alpha, and counting them would bias it low against the geometric model."""
    return num_accepted + (num_accepted < num_drafts)


@dataclass(slots=True)
class DraftRecord:
    """One sequence's recent verdicts on its drafts, exponentially weighted: what its own alpha is
    measured from. Sequences differ: a request that copies its prompt drafts far better than a chat.
    And whether the policy paused its drafting."""

    accepted: float = 0.0
    judged: float = 0.0
    answers: float = 0.0  # the drafter's answers for its prefixes, and those that carried drafts
    drafted: float = 0.0
    paused: bool = False  # no draft of it paid when last asked: drafts are weighed again after an exploring step
    guard: GuardRecord = field(default_factory=GuardRecord)  # its realized speed with speculation (SpeedGuard)

    def observe(self, num_accepted: int, num_drafts: int) -> None:
        keep = 1 - _SEQUENCE_SMOOTHING
        self.accepted = keep * self.accepted + num_accepted
        self.judged = keep * self.judged + _judged(num_accepted, num_drafts)

    def observe_answer(self, has_drafts: bool) -> None:
        keep = 1 - _SEQUENCE_SMOOTHING
        self.answers = keep * self.answers + 1
        self.drafted = keep * self.drafted + has_drafts


class SpeculationPolicy:
    """Waiting w seconds pays off when the tokens the drafts are expected to add, E[accepted],
    each saving about one step, are worth more than w. So the bound is E[accepted] * step time,
    capped by --draft-wait-ms, and it shrinks to nothing for a drafter whose drafts are rejected.
    When the drafter's answers take longer than that bound, waiting buys nothing: no wait at all,
    and its late drafts are salvaged where the committed tokens match them.

    Verifying drafts also lengthens the step, by more the larger the batch, so draft_limits caps
    each sequence's drafts where the step's expected tokens per second are highest, from a fitted
    cost model of a step and each sequence's acceptance rate alpha: its own, measured from its
    DraftRecord and drawn towards the batch's while it has few verdicts. A request that copies
    its prompt keeps speculating in a batch of chats whose drafts do not pay.

    The drafter drafts only what the target may verify: drafts_to_request asks, per sequence, for
    one more draft than its best k, and for none while its drafts do not pay (but for the steps
    before each exploring step), so that a drafter whose drafts would go unused does not compete
    with the target for the machine.

    The drafter answers every update that asks for drafts, if only with nothing. When it has left
    an update unanswered for longer than its patience (a few round trips, and at least the longest
    wait), it is taken as hung or busy: steps stop waiting for it until it answers again."""

    admission_ends_wait = True  # a prompt to admit or to continue ends a wait for drafts: waiting never delays a prefill
    drafts_before_publish = False  # committed tokens go to clients at once, without waiting for the next drafts
    accepts_predrafts = True  # sequences are opened for pre-drafts: the drafter drafts ahead, the target caches

    def __init__(self, config: TargetConfig):
        self.max_wait = config.draft_wait_ms / 1000.0
        self.mean_accepted = 1.0  # optimistic until measured, so that a new drafter gets a chance
        self.mean_step = self.max_wait
        self.mean_rtt = 0.0  # update sent -> proposal received; optimistic until measured
        self.mean_cycle = 0.0  # between decode or verify steps, each one's whole cycle; 0 until measured
        self._delays: deque[float] = deque(maxlen=_DELAY_SAMPLES)  # the latest such round trips
        self._unanswered_since: float | None = None  # the first update sent since the drafter's last answer
        self._steps = 0
        self._fit = [0.0] * 5  # exponentially weighted sums of 1, n, t, n*n, n*t over steps
        self._per_token = 0.0  # the last cost per token the fit could measure; 0 until it could
        self._decodes: dict[int, tuple[float, int]] = {}  # by batch size: a decode step's mean time, and how many
        self._paused = False  # the drafter was last asked for no sequence's drafts beyond exploring
        self._accepted = self._judged = 1.0  # alpha = 1 until measured, so that drafts get tried
        self._answers = self._drafted = 1.0  # every answer carries drafts until measured
        self.guard = SpeedGuard()

    def new_record(self) -> DraftRecord:
        """A new sequence's record: the guard decides whether it starts by speculating."""
        return DraftRecord(guard=self.guard.new_record())

    def lead_steps(self) -> int:
        """Steps a drafter's answer takes to arrive: how far ahead drafts must be asked for."""
        return 1 + math.ceil(self.mean_rtt / max(self.mean_step, _MIN_SECONDS))

    def observe_verify(self, num_accepted: int, num_drafts: int, record: DraftRecord) -> None:
        """One sequence's verification: num_accepted of its num_drafts drafts were accepted."""
        self.mean_accepted += _SMOOTHING * (num_accepted - self.mean_accepted)
        keep = 1 - _MODEL_SMOOTHING
        self._accepted = keep * self._accepted + num_accepted
        self._judged = keep * self._judged + _judged(num_accepted, num_drafts)
        record.observe(num_accepted, num_drafts)

    def observe_step(self, num_tokens: int, seconds: float, batch: int) -> None:
        """A decode or verify step: one forward pass over num_tokens tokens of `batch` sequences took
        `seconds`. A decode (a token each) is also kept as that batch size's own base time."""
        self.mean_step += _SMOOTHING * (seconds - self.mean_step)
        if num_tokens == batch:  # the plain mean of its first decodes, then a moving one: no first step sticks
            mean, count = self._decodes.get(batch, (0.0, 0))
            count += 1
            self._decodes[batch] = (mean + max(1 / count, _MODEL_SMOOTHING) * (seconds - mean), count)
        self._steps += 1
        keep = 1 - _MODEL_SMOOTHING
        sample = (1.0, num_tokens, seconds, num_tokens * num_tokens, num_tokens * seconds)
        self._fit = [keep * total + x for total, x in zip(self._fit, sample)]
        w, n, t, nn, nt = self._fit
        spread = nn / w - (n / w) ** 2
        if spread > _MIN_SPREAD:
            self._per_token = max(0.0, (nt / w - n / w * t / w) / spread)

    def observe_cycle(self, records: list[DraftRecord], speculating: list[bool], tokens: list[int],
                      seconds: float) -> None:
        """A decode or verify step's whole cycle, for the speed guard: whether each sequence could
        speculate in it, what each committed, and the wall time since the last step's."""
        weight = _SMOOTHING if self.mean_cycle else 1.0  # the first cycle sets it
        self.mean_cycle += weight * (seconds - self.mean_cycle)
        self.guard.observe(StepResult([record.guard for record in records], speculating, tokens, seconds))

    def new_drafter(self, records: list[DraftRecord]) -> None:
        """A drafter (re)connected: the speed guard measures it afresh, and how often it answers with
        drafts is learnt anew."""
        self.guard.new_drafter([record.guard for record in records])
        self._answers = self._drafted = 1.0
        for record in records:
            record.answers = record.drafted = 0.0

    def skip_step(self) -> None:
        """A step in which no sequence could verify drafts: nothing to learn from it (SpeedGuard.skip)."""
        self.guard.skip()

    def allowed(self, records: list[DraftRecord]) -> list[bool]:
        """Whether the speed guard lets each sequence verify drafts in the next step."""
        return self.guard.allowed([record.guard for record in records])

    def observe_drafts_answer(self, has_drafts: bool, record: DraftRecord) -> None:
        """The drafter answered one of the sequence's prefixes, with drafts or with nothing."""
        keep = 1 - _MODEL_SMOOTHING
        self._answers = keep * self._answers + 1
        self._drafted = keep * self._drafted + has_drafts
        record.observe_answer(has_drafts)

    def drafted_share(self, record: DraftRecord) -> float:
        """The share of the drafter's answers for this sequence that carry drafts: its own, with the
        batch's as a prior worth a few answers. A chat's lookup drafter mostly answers nothing."""
        return (record.drafted + _PRIOR_ANSWERS * self._drafted / self._answers) / (record.answers + _PRIOR_ANSWERS)

    def observe_draft_rtt(self, seconds: float) -> None:
        self.mean_rtt += _SMOOTHING * (seconds - self.mean_rtt)
        self._delays.append(seconds)

    def late_round_trip(self) -> float:
        """The draft round trip that 9 in 10 of the recent ones do not exceed; 0 until measured."""
        if not self._delays:
            return 0.0
        return sorted(self._delays)[math.ceil(0.9 * len(self._delays)) - 1]

    def observe_update_sent(self, now: float) -> None:
        """An update that the drafter will answer (Opens or Extends) was sent."""
        if self._unanswered_since is None:
            self._unanswered_since = now

    def observe_answer(self) -> None:
        """A message came from the drafter: it is alive, and steps may wait for it again."""
        self._unanswered_since = None

    @property
    def alpha(self) -> float:
        """The probability that a draft is accepted, given that the drafts before it were (all sequences)."""
        return self._accepted / self._judged

    def sequence_alpha(self, record: DraftRecord) -> float:
        """A sequence's own alpha: its verdicts, with the batch's alpha as a prior worth a few of them."""
        return (record.accepted + _PRIOR_JUDGED * self.alpha) / (record.judged + _PRIOR_JUDGED)

    def cost_model(self) -> tuple[float, float]:
        """(fixed, per_token) seconds of a step, fitted by exponentially weighted least squares.

        Until the steps seen differ in size, extra tokens look free, so that speculation gets tried.
        Once measured, the cost per token is kept while the recent steps are all alike (as while
        no draft pays): steps of one size say nothing about it, and forgetting it would make
        drafts look free again.
        """
        w, n, t, _, _ = self._fit
        if w == 0:
            return _MIN_SECONDS, 0.0
        return max(t / w - self._per_token * n / w, _MIN_SECONDS), self._per_token

    def decode_seconds(self, batch: int) -> float:
        """A decode step of `batch` sequences: measured at that batch size, or at the nearest one
        measured and the line's slope for the difference; the line alone before any was.

        The line is fitted over steps of every batch size, and a CPU's step is no line: a decode of
        one token streams every weight (10 ms on an Ice Lake core), one of eight costs 1.8x that, and
        each further token 2 ms more. The line's fixed part, about 9 ms there, would make a batch of
        eight look slower than it is, and each draft's share of a step look smaller: drafts that
        lose at batch 8 looked worth verifying."""
        fixed, per_token = self.cost_model()
        if not self._decodes:
            return fixed + per_token * batch
        nearest = min(self._decodes, key=lambda size: (abs(size - batch), size))
        return max(self._decodes[nearest][0] + per_token * (batch - nearest), _MIN_SECONDS)

    def draft_limits(self, records: list[DraftRecord], available: list[int]) -> list[int]:
        """Each sequence's drafts to verify, k_i: those that maximize the step's expected tokens per
        second (_best_limits), but for exploring.

        One step in _EXPLORE_EVERY verifies one draft fewer than a sequence's best, and one step
        in _EXPLORE_PAUSED_EVERY verifies one of each sequence whose best is none: steps of one
        size would leave the cost per token unmeasured, and verifying none, alpha, so a costlier
        batch or a better drafter would go unnoticed. Exploring costs a step's worth of drafts that
        do not pay, hence less often while none do.
        """
        available = [most if ok else 0 for most, ok in zip(available, self.allowed(records))]
        best = self._best_limits(records, available)
        explore = self._steps_to_explore(_EXPLORE_EVERY) == 0
        explore_paused = self._steps_to_explore(_EXPLORE_PAUSED_EVERY) == 0
        limits = []
        for k, most in zip(best, available):
            if k:
                limits.append(k - 1 if explore else k)
            else:
                limits.append(min(1, most) if explore_paused else 0)
        return limits

    def drafts_to_request(self, records: list[DraftRecord], caps: list[int]) -> list[int]:
        """The drafts to ask the drafter for, per sequence, from now on (0: none), given what each
        could verify.

        One more than its best k when its drafts pay, so that the policy sees when a longer draft
        would pay too. None when they do not, except for the few steps before an exploring step,
        which verifies one: it keeps alpha and the cost per token measured, so that a drafter that
        gets better, or a cheaper batch, is noticed.

        A paused sequence stays paused until an exploring step has judged its draft: what pauses it
        is a verdict, and so is what resumes it, not the noise of a step's time in the cost model.
        The speed guard may hold a sequence off besides (SpeedGuard.wanted): it then asks for none,
        but its pause stays the cost model's verdict, so that it drafts again once the guard lets it.
        """
        best = self._best_limits(records, caps)
        for k, record in zip(best, records):
            record.paused = not k
        self._paused = not any(best)
        wanted = self.guard.wanted([record.guard for record in records], caps, self.lead_steps())
        if not all(wanted):
            best = self._best_limits(records, [cap if ok else 0 for cap, ok in zip(caps, wanted)])
        explore_soon = self._steps_to_explore(_EXPLORE_PAUSED_EVERY) < _EXPLORE_LEAD
        return [(min(k + 1, cap) if k else min(1, cap) if explore_soon else 0) if ok else 0
                for k, cap, ok in zip(best, caps, wanted, strict=True)]

    def _steps_to_explore(self, every: int) -> int:
        """Steps before the next exploring one, one step in `every`; 0: the next step explores."""
        return (every - 1 - self._steps) % every

    def _best_limits(self, records: list[DraftRecord], available: list[int]) -> list[int]:
        """Sequence i's j-th draft is accepted with probability alpha_i**j, and verifying it costs
        one more token: the step's rate is (B + the sum of the verified drafts' alpha_i**j) /
        (decode_seconds(B) + per_token * drafts) seconds: a decode of B as measured, and each draft
        at the fitted cost_model's price of a token. The drafts worth most
        come first, so the best set is the first m of them by worth, for the m of the highest rate;
        as alpha_i**j falls with j, each sequence's share of them is its first k_i drafts.
        A draft raises the rate only while its worth exceeds per_token x the rate so far, and once
        one does not, none after it can (the rate falls, and stays above worth / per_token for the
        draft that lowered it): the drafts are taken by worth, from a heap of each sequence's next,
        until one does not pay. A paused sequence gets none, but right after an exploring step."""
        explored = self._steps_to_explore(_EXPLORE_PAUSED_EVERY) == _EXPLORE_PAUSED_EVERY - 1
        available = [0 if record.paused and not explored else most for record, most in zip(records, available)]
        _, per_token = self.cost_model()
        batch = len(available)
        base = self.decode_seconds(batch)
        limits = [0] * batch
        alphas = {i: self.sequence_alpha(records[i]) for i, most in enumerate(available) if most}
        heap = [(-alpha, -i) for i, alpha in alphas.items()]  # each sequence's next draft: (-worth, -i)
        heapq.heapify(heap)  # by worth, then the later sequence first (ties as a sort by (worth, i) would)
        drafts, expected = 0, float(batch)
        rate = expected / base
        while heap:
            negative_worth, negative_i = heap[0]
            drafts, expected = drafts + 1, expected - negative_worth
            taken = expected / (base + per_token * drafts)
            if taken <= rate:
                break
            rate, i = taken, -negative_i
            limits[i] += 1
            if limits[i] < available[i]:
                heapq.heapreplace(heap, (-alphas[i] ** (limits[i] + 1), negative_i))
            else:
                heapq.heappop(heap)
        return limits

    def wait_bound(self, elapsed: float = 0.0, drafted: float = 1.0) -> float:
        """How much longer a step may wait for drafts asked for `elapsed` seconds ago.

        The drafts save about mean accepted x step time when they come, and they come within w with
        the share of the drafter's recent round trips that end within elapsed + w, of those not over
        yet. `drafted` is the expected share of the step's sequences that the awaited answers bring
        drafts to: a wait holds up every sequence of the step, while only those awaiting an answer
        gain, and only from an answer that carries drafts (an answer of nothing saves nothing). The
        bound is the w that maximizes drafted x that expected saving less w, or 0 where none gains.
        So a drafter whose answers come later than --draft-wait-ms is not waited for at all, and one
        whose answers mostly come at once but sometimes late is waited for as long as they mostly
        take. Until a round trip is measured, the saving itself, at most --draft-wait-ms.

        While the drafter is paused, the exploring step waits up to --draft-wait-ms for its one
        draft: without it the step measures nothing, and a drafter whose answers come later than
        a step would stay paused for good."""
        if self._paused and self._steps_to_explore(_EXPLORE_PAUSED_EVERY) == 0:
            return self.max_wait
        saving = drafted * self.mean_accepted * self.mean_step
        if not self._delays:
            return min(self.max_wait, saving)
        return best_wait(self._delays, elapsed, saving, self.max_wait)

    @property
    def longest_wait(self) -> float:
        """No wait bound exceeds this."""
        return self.max_wait

    def patience(self) -> float:
        """How long the drafter may leave an update unanswered before steps stop waiting for it."""
        return max(_PATIENCE_RTTS * self.mean_rtt, self.longest_wait)

    def wait_deadline(self, now: float, asked_at: float, drafted: float = 1.0) -> float:
        """When a step that starts waiting now for drafts asked for at `asked_at` stops: after the
        bound, or when patience runs out. drafted: as in wait_bound."""
        deadline = now + self.wait_bound(now - asked_at, drafted)
        if self._unanswered_since is not None:
            deadline = min(deadline, self._unanswered_since + self.patience())
        return deadline


def best_wait(delays: Iterable[float], elapsed: float, saving: float, longest: float) -> float:
    """The wait w <= longest that maximizes P(the answer comes within w) x saving - w, where P is the
    share of the round trips `delays` that end within elapsed + w among those longer than elapsed;
    0 when no wait gains. Each candidate wait outlasts its round trip by _WAIT_SLACK, as the next
    answer may come a little later than the last ones did (a wait ends when the drafts come)."""
    pending = sorted(d - elapsed for d in delays if d > elapsed)
    best, gain = 0.0, 0.0
    for arrived, until in enumerate(pending, start=1):
        wait = min(longest, until * (1 + _WAIT_SLACK) + _WAIT_SLACK_SECONDS)
        if until > longest:
            break
        if arrived / len(pending) * saving - wait > gain:
            best, gain = wait, arrived / len(pending) * saving - wait
    return best


class SyncPolicy(SpeculationPolicy):
    """Synchronous speculation, the blocking design from before vLLM's non-blocking change: every
    step waits for its drafts (up to _SYNC_WAIT), even with
    a request to admit, verifies every usable draft whatever it costs, and after committing waits
    for the drafts of the new prefixes before the tokens go to the clients."""

    admission_ends_wait = False
    drafts_before_publish = True
    accepts_predrafts = False  # the blocking baseline drafts only once it knows the committed prefix

    def draft_limits(self, records: list[DraftRecord], available: list[int]) -> list[int]:
        return list(available)

    def drafts_to_request(self, records: list[DraftRecord], caps: list[int]) -> list[int]:
        return list(caps)

    def wait_bound(self, elapsed: float = 0.0, drafted: float = 1.0) -> float:
        return _SYNC_WAIT

    @property
    def longest_wait(self) -> float:
        return _SYNC_WAIT


def speculation_policy(config: TargetConfig) -> SpeculationPolicy:
    """The policy that --sync-speculation asks for."""
    return SyncPolicy(config) if config.sync_speculation else SpeculationPolicy(config)
