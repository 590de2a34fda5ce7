"""Pre-drafting: the drafter's side of the speculation cache (docs/design/speculation-cache.md).

After proposing d1..dk for a committed prefix C of length L, the drafter does not wait for the
target's next Extend. It drafts ahead for the likely outcomes of the verification the target is
running: j drafts accepted (0 <= j <= k), then the next token b, which the drafter guesses from its
own distribution: for j < k its few most likely tokens other than d(j+1) at position L+j (the
recovered token; --predraft-guesses of them, each an outcome of its own), for j = k its top token
at position L+k (the bonus token). For outcome (j, b) it drafts
the tokens that continue C + d1..dj + b and sends them as an ordinary proposal whose assumed_ids
are d1..dj, b. When the next Extend commits exactly those tokens, the target already holds drafts
for its new prefix, and the drafter goes straight on to the outcomes of that proposal.

Over a long link one verification ahead is too few: a pre-draft made when an Extend arrives reaches
the target a round trip later, after the step it was made for has started. So the drafter pre-drafts
the outcomes of its pre-drafts too, as many verifications ahead as the target's draft round trip
spans of its step interval (both sent with every update), at most --max-predraft-depth: a tree of
proposals whose root is the one under verification. When an Extend commits one of them, its
subtree stays sent and only the next level is drafted.

Which outcomes: the expected gain of (j, b) is P(j) x P(b right | j), with P(j) = alpha^j (1 - alpha)
for j < k and alpha^k for j = k; alpha is the per-draft acceptance the drafter measures from the
Extends it receives (how many leading drafts were committed). For a recovered token, P(b right) is
the drafter's own probability of b given that d(j+1) was rejected, scaled by how often its guesses
have been right against how often it expected them to be; for the bonus token, its measured hit
rate, optimistic until measured. Deeper in the tree an outcome's gain is multiplied by its
proposal's (the chance that the target verifies that proposal at all). How many: `Fanout`, from
the drafter's spare time, per round; a round drafts one more level of the tree.

Lossless, as any proposal. A pre-draft's drafts are drawn as a fresh proposal from the same prefix
draws them: from the q' it sends, with the drafter's own salt, keyed by (seed, prefix, position)
(`drafters/model.py: noise_seed`), or greedily, or with the shared noise in drafter-invariant mode.
The target uses a cached proposal only when its assumed tokens equal what it committed. The
verification that committed them, through position L+j, looked at the drafter's noise only at
positions up to L+j. Which outcomes the drafter covered depends on the gains, and so on the drafts
of the proposal under verification and of the other outcomes' pre-drafts, at positions that overlap
this pre-draft's; those drafts continue other prefixes, so their noise is independent of its own.
(Keyed by position alone, it would be shared: a pre-draft's existence would depend on its own
draws.) So given the committed prefix, the chosen proposal's drafts are draws from its q' rows,
independent of the verifier's noise and of why the proposal exists: the premise of rejection
sampling, exactly as for a fresh proposal. Deeper in the tree the same holds level by level: every
proposal a pre-draft's existence depends on continues another prefix. The lookup drafters draw no
noise: their drafts are a function of the prefix.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from draft_service.drafter import DraftJob, DraftSequence, Guess, Drafted, SeqKey
from draft_service.metrics import DraftMetrics
from tandem.protos import MAX_HELD_PROPOSALS

DECAY = 0.98  # per observation: a rate follows about the last 50
PRIOR_WEIGHT = 2.0  # how many trials the prior counts for


@dataclass(slots=True)
class Rate:
    """A probability measured over recent trials: exponentially decayed counts, starting from a prior."""

    prior: float
    hits: float = 0.0
    trials: float = 0.0

    def observe(self, hits: int, trials: int) -> None:
        self.hits = self.hits * DECAY + hits
        self.trials = self.trials * DECAY + trials

    @property
    def value(self) -> float:
        return (self.hits + self.prior * PRIOR_WEIGHT) / (self.trials + PRIOR_WEIGHT)


@dataclass(slots=True)
class OutcomeModel:
    """P(j) and P(b right | j), as the drafter measures them."""

    acceptance: Rate = field(default_factory=lambda: Rate(prior=0.5))  # alpha, per draft
    # Per rejection: whether one of the recovered-token guesses was right, and the probability
    # the drafter gave them together; their ratio calibrates its beliefs.
    recovered_hits: Rate = field(default_factory=lambda: Rate(prior=1.0))
    recovered_expected: Rate = field(default_factory=lambda: Rate(prior=1.0))
    bonus_hits: Rate = field(default_factory=lambda: Rate(prior=1.0))

    def gain(self, accepted: int, num_drafts: int, guess: Guess | None = None) -> float:
        """Of the outcome `accepted` drafts, then `guess` (a recovered token) or the bonus token (None)."""
        alpha = self.acceptance.value
        if guess is None:
            return alpha**num_drafts * self.bonus_hits.value
        calibration = self.recovered_hits.value / max(self.recovered_expected.value, 1e-6)
        return alpha**accepted * (1 - alpha) * min(1.0, guess.probability * calibration)


@dataclass(slots=True)
class SentProposal:
    """A proposal the target holds: drafts for the prefix `tokens` (committed tokens, then assumed ones)."""

    tokens: list[int]
    drafts: list[int]
    recovered_guesses: list[list[Guess]]  # per draft, best first
    depth: int = 0  # verifications after the current proposal's before the target would verify it
    gain: float = 1.0  # the chance, as the drafter expects, that the target verifies it after the current one
    expanded: bool = False  # some of its outcomes were pre-drafted (or are pending)
    # The pre-drafts sent for its outcomes, by (accepted, next token); the bonus outcome's token is None.
    children: dict[tuple[int, int | None], SentProposal] = field(default_factory=dict)

    def descendants(self) -> list[SentProposal]:
        """Every pre-draft sent below it: its children, theirs, and so on."""
        found, stack = [], list(self.children.values())
        while stack:
            node = stack.pop()
            found.append(node)
            stack.extend(node.children.values())
        return found


@dataclass(slots=True)
class Outcome:
    """One way the verification of `parent` may end: `accepted` drafts committed, then `next_token`."""

    parent: SentProposal
    accepted: int
    next_token: int | None  # None: all drafts accepted; the drafter guesses the bonus token as it pre-drafts
    gain: float  # the parent's gain times this outcome's chance given the parent


@dataclass(slots=True)
class Fanout:
    """Outcomes per proposal to pre-draft: one more after a round that ended well before the next
    Extend, half as many when an Extend comes before a sequence's pre-drafts are done."""

    cap: int  # --max-fanout: 0 turns pre-drafting off
    limit: int = field(init=False)

    def __post_init__(self) -> None:
        self.limit = self.cap  # optimistic: rows are nearly free to a memory-bound drafter

    def on_late(self) -> None:
        self.limit = min(self.cap, max(1, self.limit // 2))

    def on_spare(self, spare_s: float, round_s: float, outcomes: int) -> None:
        """spare_s: from the end of a pre-draft round of `outcomes` outcomes per sequence to the next Extend."""
        # An outcome more per sequence costs at most a round's time per outcome, less in practice.
        if outcomes and spare_s > round_s / outcomes:
            self.limit = min(self.cap, self.limit + 1)


@dataclass(slots=True)
class SequenceState:
    sequence: DraftSequence
    current: SentProposal | None = None  # the proposal for the committed tokens, which the target verifies
    pending: list[Outcome] = field(default_factory=list)  # outcomes that wait for a pre-draft round
    in_flight: list[Outcome] = field(default_factory=list)  # outcomes a running pre-draft round drafts
    predrafted_at: float | None = None  # when its last pre-draft round ended
    predraft_round_s: float = 0.0
    predraft_outcomes: int = 0


class Predrafter:
    """Each sequence's proposal under verification, its outcomes, and the pre-drafts sent for them.

    Runs on the event loop. The scheduler calls `on_extend` for each Extend before it changes the
    tokens; `covers` when it plans a round for a sequence whose tokens changed; `take_jobs` for a
    pre-draft round; `on_drafted` and `on_predrafted` as it delivers a round's proposals.
    """

    def __init__(self, max_fanout: int, metrics: DraftMetrics, max_depth: int = 1):
        """max_depth: verifications ahead to pre-draft at most, however long the round trip."""
        self.fanout = Fanout(max_fanout)
        self.model = OutcomeModel()
        self.max_depth = max_depth
        self._metrics = metrics
        self._states: dict[SeqKey, SequenceState] = {}
        self._pending: dict[SeqKey, SequenceState] = {}
        self._in_flight: dict[int, tuple[SequenceState, Outcome]] = {}  # by id() of the round's jobs
        self._spans: dict[int, int] = {}  # by stream: the target's steps its draft round trip spans, at least 1
        metrics.fanout_limit.set(self.fanout.limit)

    def on_timing(self, stream_id: int, round_trip_s: float, step_s: float) -> None:
        """A target's draft round trip and step interval: pre-drafts made as an Extend arrives reach
        it a round trip later, so they are for the verification that many steps on, and the ones before."""
        self._spans[stream_id] = 1 if step_s <= 0 else 1 + int(round_trip_s // step_s)
        self._metrics.predraft_depth.set(self.depth(stream_id))

    def depth(self, stream_id: int) -> int:
        """The verifications ahead that a stream's pre-drafts reach: 1 until its target tells its timing."""
        return min(self.max_depth, self.spans(stream_id))

    def spans(self, stream_id: int) -> int:
        """The target's steps its draft round trip spans: more than 1 over a link longer than a step."""
        return self._spans.get(stream_id, 1)

    def close_stream(self, stream_id: int) -> None:
        self._spans.pop(stream_id, None)

    def open(self, sequence: DraftSequence) -> None:
        self._states[sequence.key] = SequenceState(sequence)

    def close(self, key: SeqKey) -> None:
        self._states.pop(key, None)
        self._pending.pop(key, None)

    def has_pending(self) -> bool:
        return bool(self._pending)

    def on_extend(self, sequence: DraftSequence, start: int, token_ids: list[int], now: float) -> None:
        """Before the tokens change: measure the outcome, adjust the fan-out, cancel the moot pre-drafts."""
        state = self._states[sequence.key]
        undone = (*state.pending, *state.in_flight)
        if any(outcome.parent is state.current for outcome in undone):
            self.fanout.on_late()  # this verification's outcomes were not all drafted yet
        elif not undone and state.predrafted_at is not None:  # deeper levels undone: not late, not spare
            self.fanout.on_spare(now - state.predrafted_at, state.predraft_round_s, state.predraft_outcomes)
        self._metrics.fanout_limit.set(self.fanout.limit)
        if state.pending:
            self._metrics.predraft_cancelled["pending"].inc(len(state.pending))
            for outcome in state.pending:  # planned anew from wherever the Extend leaves the tree
                outcome.parent.expanded = False
            state.pending = []
            del self._pending[sequence.key]
        state.predrafted_at = None
        if state.current is not None and start == len(sequence.tokens) and sequence.tokens == state.current.tokens:
            self._observe(state, token_ids)

    def _observe(self, state: SequenceState, token_ids: list[int]) -> None:
        """Which outcome the target's verification of the current proposal had, and whether the guess was right."""
        drafts = state.current.drafts
        accepted = 0
        while accepted < min(len(drafts), len(token_ids)) and token_ids[accepted] == drafts[accepted]:
            accepted += 1
        rejected = accepted < len(drafts) and len(token_ids) > accepted
        self.model.acceptance.observe(accepted, accepted + rejected)
        if len(token_ids) == accepted:  # a stop ended the sequence on an accepted draft
            return
        actual = token_ids[accepted]
        if accepted < len(state.current.recovered_guesses) and accepted < len(drafts):
            guesses = state.current.recovered_guesses[accepted]
            if guesses:
                self.model.recovered_expected.observe(sum(g.probability for g in guesses), 1)
                self._count_guess("recovered", self.model.recovered_hits, actual in [g.token for g in guesses])
        elif accepted == len(drafts) and (guess := self._bonus_guess(state)) is not None:
            self._count_guess("bonus", self.model.bonus_hits, actual == guess)

    @staticmethod
    def _bonus_guess(state: SequenceState) -> int | None:
        """The current proposal's guess at its bonus token, once that outcome is pre-drafted."""
        child = state.current.children.get((len(state.current.drafts), None))
        return None if child is None else child.tokens[-1]

    def _count_guess(self, kind: str, rate: Rate, right: bool) -> None:
        rate.observe(right, 1)
        self._metrics.outcomes_seen[kind].inc()
        if right:
            self._metrics.guesses_right[kind].inc()

    def covers(self, sequence: DraftSequence) -> bool:
        """Whether a sent pre-draft covers the committed tokens exactly; if one does, the target verifies
        it now, so its outcomes are what to pre-draft next."""
        state = self._states[sequence.key]
        tree = state.current.descendants() if state.current is not None else []
        covering = next((p for p in tree if p.tokens == sequence.tokens), None)
        if covering is None:
            self._make_current(state, None)
            return False
        self._metrics.predraft_hits.inc()
        for p in covering.descendants():  # now counted from the covering proposal, which the target verifies next
            p.depth -= covering.depth
            p.gain /= max(covering.gain, 1e-12)
        covering.depth, covering.gain, covering.expanded = 0, 1.0, False  # its undrafted outcomes come first
        self._make_current(state, covering)
        return True

    def pause(self, sequence: DraftSequence) -> None:
        """The target wants no drafts of this sequence for now: no proposal of it is current, none pending."""
        self._make_current(self._states[sequence.key], None)

    def on_drafted(self, job: DraftJob, draft: Drafted | None) -> None:
        """A fresh proposal was sent: if it still answers the newest tokens, the target verifies it next."""
        state = self._states.get(job.sequence.key)
        if state is None or state.sequence.tokens != job.tokens:
            return  # closed, or moved on meanwhile: sent only for the target to salvage
        proposal = SentProposal(job.tokens, draft.token_ids, draft.recovered_guesses) if draft else None
        self._make_current(state, proposal if draft and draft.token_ids else None)

    def _make_current(self, state: SequenceState, proposal: SentProposal | None) -> None:
        """The proposal the target verifies next; the pre-drafts below it stay sent."""
        state.current, state.pending = proposal, []
        self._pending.pop(state.sequence.key, None)
        if proposal is not None:
            self._plan(state, [proposal, *proposal.descendants()])

    def _plan(self, state: SequenceState, candidates: list[SentProposal]) -> None:
        """Pend the best outcomes of the candidates not yet expanded that the target would verify
        before the depth its timing asks for."""
        if not state.sequence.accepts_assumed or not self.fanout.limit:
            return
        depth = self.depth(state.sequence.key[0])
        frontier = [p for p in candidates if not p.expanded and p.depth < depth]
        outcomes = sorted((o for p in frontier for o in self._outcomes(p)
                           if (o.accepted, o.next_token) not in p.children), key=lambda o: -o.gain)
        room = MAX_HELD_PROPOSALS - 2 - len(state.current.descendants())  # and the current and a fresh one
        state.pending = outcomes[: max(0, min(self.fanout.limit, room))]
        for outcome in state.pending:
            outcome.parent.expanded = True
        if state.pending:
            self._pending[state.sequence.key] = state

    def _outcomes(self, proposal: SentProposal) -> list[Outcome]:
        """Every outcome the drafter can guess, by expected gain (ties: fewer accepted drafts first)."""
        n = len(proposal.drafts)
        outcomes = [Outcome(proposal, j, guess.token, proposal.gain * self.model.gain(j, n, guess))
                    for j, guesses in enumerate(proposal.recovered_guesses[:n]) for guess in guesses
                    if guess.token != proposal.drafts[j]]
        outcomes.append(Outcome(proposal, n, None, proposal.gain * self.model.gain(n, n)))
        return sorted(outcomes, key=lambda o: -o.gain)

    def take_jobs(self) -> list[DraftJob]:
        """Every pending outcome as a pre-draft job, best expected gain first."""
        scored: list[tuple[float, DraftJob]] = []
        for state in self._pending.values():
            for outcome in state.pending:
                job = outcome_job(state.sequence, len(state.current.tokens), outcome)
                self._in_flight[id(job)] = state, outcome
                scored.append((outcome.gain, job))
            state.in_flight, state.pending = state.pending, []
        self._pending.clear()
        scored.sort(key=lambda pair: -pair[0])
        return [job for _, job in scored]

    def on_predrafted(self, drafts: list[Drafted], now: float, round_s: float) -> list[Drafted]:
        """The round's pre-drafts that are still worth sending: the target has committed a prefix of
        their tokens (none of them, some, or all), and their proposal is still in the tree. The
        others are dropped. Then each sequence that stayed where it was plans the tree's next level:
        the outcomes of the pre-drafts just sent."""
        sent: list[Drafted] = []
        per_sequence: Counter[SeqKey] = Counter()
        new_level: dict[SeqKey, list[SentProposal]] = {}
        trees: dict[SeqKey, set[int]] = {}
        for draft in drafts:
            state, outcome = self._in_flight.get(id(draft.job), (None, None))
            if state is None or state.sequence.closed or not draft.token_ids:
                continue
            prefix, committed = draft.prefix, state.sequence.tokens
            if draft.key not in trees:  # the proposals the target may still verify, as the round began
                trees[draft.key] = {id(p) for p in (state.current, *state.current.descendants())} \
                    if state.current is not None else set()
            in_tree = id(outcome.parent) in trees[draft.key]
            if not in_tree or prefix[: len(committed)] != committed:
                self._metrics.predraft_cancelled["drafted"].inc()
                continue
            node = SentProposal(prefix, draft.token_ids, draft.recovered_guesses, depth=outcome.parent.depth + 1,
                                gain=outcome.gain)
            outcome.parent.children[outcome.accepted, outcome.next_token] = node
            new_level.setdefault(draft.key, []).append(node)
            sent.append(draft)
            per_sequence[draft.key] += 1
        for state in self._end_round(now, round_s, per_sequence):
            if state.current is not None and state.sequence.tokens == state.current.tokens:
                self._plan(state, new_level.get(state.sequence.key, []))
        return sent

    def on_failed_round(self) -> None:
        self._end_round(None, 0.0, Counter())

    def _end_round(self, now: float | None, round_s: float, per_sequence: Counter[SeqKey]) -> list[SequenceState]:
        """The round's sequences, open ones only, their round ended."""
        states = list({id(state): state for state, _ in self._in_flight.values()}.values())
        self._in_flight.clear()
        for state in states:
            state.in_flight = []
            state.predrafted_at, state.predraft_round_s = now, round_s
            state.predraft_outcomes = per_sequence[state.sequence.key]
            if now is not None and not state.sequence.closed:
                self._metrics.fanout.observe(state.predraft_outcomes)
        return [state for state in states if not state.sequence.closed]


def outcome_job(sequence: DraftSequence, known_len: int, outcome: Outcome) -> DraftJob:
    """The pre-draft of one outcome: its proposal's tokens (the first known_len committed), the
    accepted drafts, then the next token."""
    tokens = outcome.parent.tokens + outcome.parent.drafts[: outcome.accepted]
    if outcome.next_token is None:
        return DraftJob(sequence, tokens, num_assumed=len(tokens) - known_len, guess_next=True)
    return DraftJob(sequence, tokens + [outcome.next_token], num_assumed=len(tokens) + 1 - known_len)
