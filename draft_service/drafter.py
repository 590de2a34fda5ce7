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

from kernels.compression import CompressedProbs, pack
from kernels.sampling import effective_temperature
from tandem.structured import Constraint
from tandem.v1 import drafter_pb2

if TYPE_CHECKING:
    from draft_service.features import SequenceFeatures
    from draft_service.grammars import SequenceGrammar
    from tandem.hidden_states import FeatureLayout

SeqKey = tuple[int, int]  # (stream id, sequence id): sequence ids are per Speculate stream


@dataclass(frozen=True, slots=True)
class Sampling:
    """How one sequence's drafts are drawn; the target's own sampling parameters."""

    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0  # int64, as the kernels key their draws
    invariant: bool = False  # drafter-invariant mode: draw with the target's shared noise

    @classmethod
    def from_proto(cls, msg: drafter_pb2.DraftSampling) -> "Sampling":
        """Proto3 leaves an unset top_p at 0, which means off; the uint64 seed becomes its int64 bits.

        A temperature too small to divide logits by is greedy, as on the target."""
        seed = msg.seed - (1 << 64) if msg.seed >= 1 << 63 else msg.seed
        return cls(effective_temperature(msg.temperature), msg.top_k, msg.top_p or 1.0, msg.min_p, seed,
                   msg.drafter_invariant)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def sends_probs(self) -> bool:
        """Rejection sampling needs q'; greedy and drafter-invariant verification need ids only."""
        return not self.greedy and not self.invariant

    def problem(self) -> str | None:
        """Why the kernels would refuse these parameters, or None."""
        if not (self.temperature >= 0 and self.temperature != float("inf")):
            return f"temperature {self.temperature} must be finite and >= 0"
        if not 0 < self.top_p <= 1:
            return f"top_p {self.top_p} must be in (0, 1]"
        if not 0 <= self.min_p <= 1:
            return f"min_p {self.min_p} must be in [0, 1]"
        return None


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
    open_k: int = field(init=False)  # the Open's k: the most an Extend may ask for

    def __post_init__(self) -> None:
        self.open_k = self.k

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


@dataclass(frozen=True, slots=True)
class Guess:
    """A guess at the token the target emits after rejecting a draft, and how likely the drafter finds it."""

    token: int
    probability: float


@dataclass(slots=True)
class Draft:
    """Draft tokens for positions base_len.. of one sequence, with q' when the target needs it."""

    key: SeqKey
    base_len: int
    token_ids: list[int]
    probs: bytes = b""  # kernels.compression.pack of q', one row per draft token
    probs_top_k: int = 0
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
        return drafter_pb2.DraftProposal(seq_id=self.key[1], base_len=self.base_len, token_ids=self.token_ids,
                                         probs=self.probs, probs_top_k=self.probs_top_k, assumed_ids=self.assumed_ids)


def make_draft(job: DraftJob, token_ids: list[int], compressed: CompressedProbs | None,
               recovered_guesses: list[list[Guess]] | None = None, guessed_next: int | None = None) -> Draft:
    """A Draft carrying q' (packed) for rejection sampling, or ids only when compressed is None.

    guessed_next: the bonus token a guess_next job guessed, the last of its assumed tokens.
    """
    assumed = job.tokens[job.known_len :] + ([] if guessed_next is None else [guessed_next])
    draft = Draft(job.sequence.key, job.base_len, token_ids, assumed_ids=assumed,
                  recovered_guesses=recovered_guesses or [], job=job)
    if compressed is not None:
        draft.probs, draft.probs_top_k = pack(compressed), compressed.k
    return draft


def never() -> bool:
    """A `stop` for rounds that run to the end."""
    return False


class Drafter(Protocol):
    """A source of draft tokens; every method runs on the drafting thread."""

    kind: str  # "model" or "ngram", as Info reports it
    probs_top_k: int  # K of the q' it sends, as Info reports it
    feature_layout: FeatureLayout | None  # the target features it reads (Info's hidden_layers), or None

    def open(self, key: SeqKey) -> None:
        """Reserve per-sequence state (a KV slot)."""

    def close(self, key: SeqKey) -> None:
        """Free what `open` reserved."""

    def settle(self, key: SeqKey, committed: list[int]) -> None:
        """The target committed these tokens (all of them, prompt included): state kept for outcomes
        that did not happen may go, state drafted for the one that did is kept."""

    def draft(self, jobs: list[DraftJob], stop: Callable[[], bool] = never) -> list[Draft]:
        """Up to each job's k draft tokens, batched; jobs with nothing to propose may be left out.

        A pre-draft job (job.is_predraft) may also be left out when the drafter has no room for it.
        stop: polled between forward passes; once it says so, return the drafts made so far (fewer
        than k each, none for a job without one yet), so that fresh work need not wait a whole round."""
