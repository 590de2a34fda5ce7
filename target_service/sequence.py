"""A request's state while the target serves it: status, tokens, KV slot, usage, output stream.

What the drafter knows of it, and proposed for it, is the Speculator's (speculation/drafter_state.py)."""
from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field

import logging

from tandem_kernels.logits_processors import LogitsContext
from tandem_kernels.logprobs import TokenLogprob
from tandem_kernels.sampling import Sampling
from tandem.detokenizer import IncrementalDetokenizer
from tandem.structured import Constraint
from tandem.structured.grammar import Matcher
from target_service.step_items import Chunk, Drafts
from target_service.stops import StopChecker

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RequestOptions:
    """A request's validated parameters, with defaults filled in: how to sample, when to stop, how to speculate."""

    sampling: Sampling
    max_tokens: int
    stop: tuple[str, ...]
    stop_token_ids: frozenset[int]
    ignore_eos: bool
    skip_special_tokens: bool
    speculate: bool
    num_speculative_tokens: int
    constraint: Constraint | None = None  # structured output: the grammar every generated token follows
    min_tokens: int = 0  # no stop token or stop string ends the sequence before this many tokens
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # the top log-probabilities to return per generated token; None: none
    prompt_logprobs: int | None = None  # the same per prompt token, from the second on
    n: int = 1  # samples of the prompt, each its own sequence, sharing one prefill


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued for admission
    RUNNING = "running"  # holds a KV slot; steps prefill, then decode or verify it
    FINISHED = "finished"  # its slot is freed and its last message sent


class FinishReason(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(frozen=True, slots=True)
class Output:
    """One message for the client's stream."""

    token_ids: list[int]
    text: str
    num_accepted: int
    finish: FinishReason | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token, when the request asked for them
    prompt_logprobs: list[TokenLogprob] | None = None  # the first output's: prompt tokens 1.., when asked
    index: int = 0  # which of the request's n samples it belongs to


@dataclass(eq=False, slots=True)
class Sequence:
    seq_id: int
    request_id: str
    prompt_ids: list[int]
    options: RequestOptions
    arrival: float
    detokenizer: IncrementalDetokenizer
    stops: StopChecker
    outbox: asyncio.Queue = field(default_factory=asyncio.Queue)  # shared by the request's samples
    index: int = 0  # which of the request's n samples this is
    group: int = 0  # the seq_id of the request's first sample: the samples are admitted and prefilled together
    token_ids: list[int] = field(default_factory=list)  # prompt + committed
    status: SequenceStatus = SequenceStatus.WAITING
    slot: int | None = None
    cached_tokens: int = 0  # usage: prompt tokens whose KV its slot already held (prefix caching): not prefilled
    # The positions whose KV its slot holds, from 0: the prefix cache's hit at admission, then each
    # prompt chunk, the prompt's end, each verify (all committed tokens but the newest), and after a
    # preemption the hit of its new slot; its next step runs the positions from here.
    num_computed_tokens: int = 0
    scored_prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # its prompt's earlier chunks scored these
    draft_tokens: int = 0  # usage: drafts verified
    # usage: [a] counts the steps that verified drafts and committed a of them (draft_steps, accepted_tokens)
    acceptance_histogram: list[int] = field(default_factory=list)
    admitted_at: float | None = None
    last_token_at: float | None = None
    finish: FinishReason | None = None
    grammar: Matcher | None = None  # the constraint's matcher, advanced over every committed token

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_ids)
        self.group = self.group or self.seq_id

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - len(self.prompt_ids)

    def prompt_chunk(self, end: int, copy_of: int | None = None) -> Chunk:
        """Its prompt from what its slot holds to `end`: at the prompt's end, the chunk samples its
        first token. copy_of: the chunk of another sample of its request that runs the prompt."""
        start, prompt, options = self.num_computed_tokens, self.prompt_ids, self.options
        last = end == len(prompt)
        return Chunk(seq_id=self.seq_id, slot=self.slot, start=start, token_ids=tuple(prompt[start:end]),
                     sampling=options.sampling, samples=last, grammar=self.grammar,
                     logits_context=self.logits_context() if last else None, logprobs=options.logprobs,
                     prompt_logprobs=options.prompt_logprobs,
                     scored=tuple(prompt[start + 1:end + 1]) if options.prompt_logprobs is not None else (),
                     copy_of=copy_of)

    def running_chunk(self, drafts: Drafts | None) -> Chunk:
        """Its next step once running: the committed tokens its slot lacks KV for (its newest, and
        after a preemption those before it), then the drafts to verify."""
        start, options = self.num_computed_tokens, self.options
        return Chunk(seq_id=self.seq_id, slot=self.slot, start=start, token_ids=tuple(self.token_ids[start:]),
                     sampling=options.sampling, drafts=drafts, grammar=self.grammar,
                     logits_context=self.logits_context(drafts.tokens if drafts else ()), logprobs=options.logprobs,
                     replayed=len(self.token_ids) - 1 - start)

    @property
    def draft_steps(self) -> int:
        """Steps that verified at least one draft."""
        return sum(self.acceptance_histogram)

    @property
    def accepted_tokens(self) -> int:
        """Accepted drafts that were committed."""
        return sum(a * steps for a, steps in enumerate(self.acceptance_histogram))

    def count_draft_step(self, num_drafts: int, accepted: int) -> None:
        self.draft_tokens += num_drafts
        self.acceptance_histogram.extend([0] * (accepted + 1 - len(self.acceptance_histogram)))
        self.acceptance_histogram[accepted] += 1

    @property
    def stop_reason(self) -> int | str | None:
        """What stopped it, as vLLM reports it: the stop string or the request's stop token id; None
        for an end-of-sequence token, a finished grammar or a length limit."""
        if self.finish is not FinishReason.STOP:
            return None
        if self.stops.matched is not None:
            return self.stops.matched
        last = self.token_ids[-1]
        return last if last in self.options.stop_token_ids else None

    @property
    def remaining_tokens(self) -> int:
        return self.options.max_tokens - self.num_generated

    def commit(self, tokens: list[int], num_accepted: int, max_len: int,
               logprobs: list[TokenLogprob] | None = None) -> tuple[Output, FinishReason | None]:
        """Append tokens one by one, so stops and budgets end the sequence where the target alone would.

        logprobs: one per token, when the request asked for them; those of the tokens kept go out."""
        emitted: list[int] = []
        text_parts: list[str] = []
        finish, hit_stop_string = None, False
        for token in tokens:
            self.token_ids.append(token)
            emitted.append(token)
            if self.stops.is_stop_token(token):
                finish = FinishReason.STOP
                break
            grammar_done = self._advance_grammar(token)
            text, hit_stop_string = self.stops.add_text(self.detokenizer.feed(token), self._may_stop)
            text_parts.append(text)
            if hit_stop_string or grammar_done:
                finish = FinishReason.STOP
                break
            if self.remaining_tokens <= 0 or len(self.token_ids) >= max_len:
                finish = FinishReason.LENGTH
                break
        if finish is not None and not hit_stop_string:
            tail, hit_stop_string = self.stops.add_text(self.detokenizer.flush(), self._may_stop)
            text_parts.append(tail if hit_stop_string else tail + self.stops.flush())
            if hit_stop_string:  # the text the last token completed holds a stop string: it stopped there
                finish = FinishReason.STOP
        output = Output(token_ids=emitted, text="".join(text_parts), num_accepted=min(num_accepted, len(emitted)),
                        logprobs=None if logprobs is None else logprobs[: len(emitted)], index=self.index)
        return output, finish

    @property
    def _may_stop(self) -> bool:
        """Past min_tokens: a stop string in the text just generated ends the sequence (vLLM's rule)."""
        return self.num_generated > self.options.min_tokens

    def logits_context(self, drafts: tuple[int, ...] = ()) -> LogitsContext | None:
        """What the logits rules of the next positions read (the tokens before them, and EOS and the
        stop tokens banned until min_tokens is reached); None when no rule applies."""
        sampling = self.options.sampling
        ban_rows = self.options.min_tokens - self.num_generated
        if not sampling.processes_logits and ban_rows <= 0:
            return None
        banned = tuple(sorted(self.stops.stop_token_ids)) if ban_rows > 0 else ()
        history = tuple(self.token_ids) if sampling.reads_history else ()
        return LogitsContext(history, len(self.prompt_ids), drafts, banned, max(ban_rows, 0))

    def _advance_grammar(self, token: int) -> bool:
        """Feed the token to the grammar; True once the grammar allows nothing more (it is complete).

        Tokens come from distributions masked by this grammar, so it accepts them. Should it not,
        the sequence ends rather than continue unconstrained."""
        if self.grammar is None:
            return False
        if not self.grammar.consume_token(token):
            log.error("%s: the grammar refused committed token %d: %s", self.request_id, token,
                      self.grammar.get_error())
            return True
        return self.grammar.is_stopped()
