"""What every drafter implements, and the data the drafting loop hands it.

The drafting loop (scheduler.py) owns the committed tokens of each sequence on the event loop.
For each round it snapshots the sequences that changed into `DraftJob`s (or pre-drafts, jobs that
also assume tokens the target has not sent: predraft.py) and calls `draft` on the drafter's own
thread; `open`, `close` and `settle` run on that same thread, in the order they arrived, so a
drafter needs no locks.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from tandem_kernels.compression import CompressedProbs, pack
from tandem_kernels.logits_processors import LogitsContext
from tandem_kernels.sampling import Sampling
from tandem.structured import Constraint
from tandem.v1 import drafter_pb2

if TYPE_CHECKING:
    from draft_service.features import SequenceFeatures
    from draft_service.grammars import SequenceGrammar
    from tandem.hidden_states import FeatureLayout

SeqKey = tuple[int, int]  # (stream id, sequence id): sequence ids are per Speculate stream


def sampling_of(msg: drafter_pb2.DraftSampling) -> Sampling:
    """Proto3 leaves an unset top_p and repetition_penalty at 0, which mean off; the uint64 seed becomes
    its int64 bits."""
    seed = msg.seed - (1 << 64) if msg.seed >= 1 << 63 else msg.seed
    return Sampling(msg.temperature, msg.top_k, msg.top_p or 1.0, msg.min_p, seed, msg.drafter_invariant,
                    presence_penalty=msg.presence_penalty, frequency_penalty=msg.frequency_penalty,
                    repetition_penalty=msg.repetition_penalty or 1.0,
                    logit_bias=tuple(sorted(msg.logit_bias.items())), allowed_token_ids=tuple(msg.allowed_token_ids),
                    bad_words=tuple(tuple(word.token_ids) for word in msg.bad_words))


@dataclass(slots=True)
class DraftSequence:
    """The drafter's copy of one target sequence of one stream, as the target last described it."""

    key: SeqKey
    tokens: list[int]  # committed tokens, prompt included
    sampling: Sampling
    k: int  # drafts per proposal: the Open's k, or what an Extend asked for since; 0 pauses drafting
    accepts_assumed: bool = False  # the target keeps pre-drafts (proposals with assumed_ids) for it
    closed: bool = False  # set on the event loop; a running round drops the sequence when it sees it
    constraint: Constraint | None = None  # structured output: drafts must follow it from constrained_from on
    constrained_from: int = 0
    grammar: SequenceGrammar | None = None  # the constraint compiled (grammars.py); the drafter's thread only
    features: SequenceFeatures | None = None  # the target's features, for a drafter that reads them
    prompt_len: int = 0  # tokens from here on were generated: penalties and min_tokens count them
    min_tokens: int = 0  # min_tokens_banned may not be drafted before this many tokens follow the prompt
    min_tokens_banned: tuple[int, ...] = ()
    open_k: int = field(init=False)  # the Open's k: the most an Extend may ask for

    def __post_init__(self) -> None:
        self.open_k = self.k

    def logits_context(self, tokens: list[int]) -> LogitsContext | None:
        """What the logits rules of the position after `tokens` read, as the target's do; None when no rule applies."""
        banned = len(tokens) - self.prompt_len < self.min_tokens
        if not self.sampling.processes_logits and not banned:
            return None
        history = tokens if self.sampling.reads_history else ()
        return LogitsContext(history, self.prompt_len, (), self.min_tokens_banned if banned else (), int(banned))

    @property
    def paused(self) -> bool:
        """The target verifies no drafts of this sequence's prefixes for now, and expects no answer."""
        return self.k == 0

    @property
    def undraftable(self) -> bool:
        """Constrained, but its grammar could not be compiled here: no draft could be trusted to follow it."""
        return self.constraint is not None and self.grammar is None


@dataclass(slots=True)
class DraftJob:
    """One prefix to draft in a round: a sequence's committed tokens at the round's start, and for a
    pre-draft (predraft.py) the tokens it assumes the target will commit next."""

    sequence: DraftSequence
    tokens: list[int]  # a snapshot (the event loop may change sequence.tokens meanwhile), assumed tokens last
    num_assumed: int = 0  # trailing tokens of `tokens` that the target has not sent
    # A pre-draft of the outcome "all drafts accepted": the drafter first appends its own guess at
    # the bonus token, then drafts after it.
    guess_next: bool = False
    # A lookup drafter's fresh job over a link longer than a step: the drafts to reach for, beyond k
    # (0: k). The target commits tokens while the proposal travels; it verifies the drafts past them,
    # and a longer proposal keeps k of those. Fixed when the job is made: the live k may change.
    reach: int = 0

    @property
    def known_len(self) -> int:
        """The committed tokens the target had sent."""
        return len(self.tokens) - self.num_assumed

    @property
    def base_len(self) -> int:
        return len(self.tokens) + self.guess_next

    @property
    def is_predraft(self) -> bool:
        return self.num_assumed > 0 or self.guess_next

    @property
    def max_drafts(self) -> int:
        """The most draft tokens a lookup drafter proposes for it."""
        return max(self.sequence.k, self.reach)


@dataclass(frozen=True, slots=True)
class Guess:
    """A guess at the token the target emits after rejecting a draft, and how likely the drafter finds it."""

    token: int
    probability: float


@dataclass(slots=True)
class Drafted:
    """What a drafter drafted for one job: draft tokens for positions base_len.. of one sequence, with q'
    when the target needs it; sent as a DraftProposal (docs/design/architecture.md, Glossary: proposal)."""

    key: SeqKey
    base_len: int
    token_ids: list[int]
    q_prime: CompressedProbs | None = None  # one row per draft token; None: ids only (packed in to_proto)
    assumed_ids: list[int] = field(default_factory=list)  # positions base_len - len(assumed_ids) .. base_len - 1
    # Not sent: recovered_guesses[i] are the drafter's guesses at the token the target emits if it
    # rejects token_ids[i], its most likely tokens other than token_ids[i], best first (empty: none).
    recovered_guesses: list[list[Guess]] = field(default_factory=list)
    job: DraftJob | None = None  # not sent: the job it was drafted for

    @property
    def prefix(self) -> list[int]:
        """The tokens the drafts continue: positions 0 .. base_len - 1."""
        guessed = [self.assumed_ids[-1]] if self.job.guess_next else []
        return self.job.tokens + guessed

    def to_proto(self) -> drafter_pb2.DraftProposal:
        message = drafter_pb2.DraftProposal(seq_id=self.key[1], base_len=self.base_len, token_ids=self.token_ids,
                                            assumed_ids=self.assumed_ids)
        if self.q_prime is not None:
            message.probs, message.probs_top_k = pack(self.q_prime), self.q_prime.k
        return message


def make_drafted(job: DraftJob, token_ids: list[int], q_prime: CompressedProbs | None,
                  recovered_guesses: list[list[Guess]] | None = None, guessed_next: int | None = None) -> Drafted:
    """A Drafted carrying q' for rejection sampling, or ids only when q_prime is None.

    guessed_next: the bonus token a guess_next job guessed, the last of its assumed tokens.
    """
    assumed = job.tokens[job.known_len :] + ([] if guessed_next is None else [guessed_next])
    return Drafted(job.sequence.key, job.base_len, token_ids, q_prime, assumed_ids=assumed,
                    recovered_guesses=recovered_guesses or [], job=job)


def common_prefix_len(a: list[int], b: list[int], likely: int = 0) -> int:
    """Length of the common prefix; `likely`, a length they probably share, is checked first at C speed."""
    n = min(len(a), len(b))
    i = likely if likely <= n and a[:likely] == b[:likely] else 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def never() -> bool:
    """A `stop` for rounds that run to the end."""
    return False


class Drafter(Protocol):
    """A source of draft tokens; every method runs on the drafting thread, or, for a drafter with
    inline_rounds, settle and draft may run on the event loop (never both at once)."""

    kind: str  # "model" or "ngram", as Info reports it
    inline_rounds: bool  # its rounds are lookups of microseconds: those that open or close nothing run on the event loop
    probs_top_k: int  # K of the q' it sends, as Info reports it
    feature_layout: FeatureLayout | None  # the target features it reads (Info's hidden_layers), or None

    def open(self, key: SeqKey) -> None:
        """Reserve per-sequence state (a KV slot)."""

    def close(self, key: SeqKey) -> None:
        """Free what `open` reserved."""

    def settle(self, key: SeqKey, committed: list[int], closing: bool = False) -> None:
        """The target committed these tokens (all of them, prompt included): state kept for outcomes
        that did not happen may go, state drafted for the one that did is kept. closing: the last
        settle before `close`, whose kept state serves later sequences, not this one."""

    def draft(self, jobs: list[DraftJob], stop: Callable[[], bool] = never) -> list[Drafted]:
        """Up to each job's k draft tokens, batched; jobs with nothing to propose may be left out.

        A pre-draft job (job.is_predraft) may also be left out when the drafter has no room for it.
        stop: polled between forward passes; once it says so, return the drafts made so far (fewer
        than k each, none for a job without one yet), so that fresh work need not wait a whole round."""

    def behind(self) -> list[SeqKey]:
        """The sequences of the last draft() that it left undrafted to go on in a later round (a long
        prompt prefilled in chunks): the scheduler drafts them again."""
