"""Drafting with a small model: one batched forward per draft position, across all jobs.

A round per batch: a catch-up forward feeds each job's tokens that its KV slot lacks (a whole
prompt after Open, a few tokens after Extend) and gives the logits for d1; then d1..d(k-1) are
fed one position at a time. A sequence's own slot keeps d1..d(k-1), so when the target commits
tokens equal to those drafts, the next catch-up starts after them: accepted drafts cost no
recompute. A rollback is a catch-up from an earlier position.

Chunked prefill: the catch-up forward runs at most max_num_batched_tokens tokens. A long prompt
that does not fit runs in chunks, in rounds of their own between the rounds that draft the
others, and is drafted once caught up (`behind`), so that it holds up no other sequence's drafts
for its whole prefill.

Structured output: a constrained job's row carries a cursor of its grammar (draft_service/grammars.py), and its
logits are masked before each token is drawn, so its drafts, guesses and q follow the grammar;
where the grammar forces the next token, the row takes it without drawing (q' = 1 on it).

Pre-drafts (predraft.py) are more rows of the same forwards, each in a scratch slot that holds the
prefix it shares with the sequence (kv_slots.py); rows are nearly free to a memory-bound drafter.
A pre-draft of "all k drafts accepted" feeds d_k, takes the drafter's top token there as its guess
at the bonus token, and feeds that too, so it ends one forward after the others. Every draft also
carries the drafter's guess at each recovered token: its most likely token other than the draft.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from draft_service.drafter import DraftJob, Drafted, Guess, SeqKey, common_prefix_len, make_drafted, never
from draft_service.drafters.kv_slots import SlotState, SlotTable
from draft_service.metrics import DraftMetrics
from tandem_kernels.bitmask import allowed_tokens
from tandem_kernels.compression import CompressedProbs, encode, point_mass, sample_compressed
from tandem_kernels.logits_processors import process_logits
from tandem_kernels.sampling import Sampling, probs_of, sample
from tandem.model.batch import DEFAULT_MAX_NUM_BATCHED_TOKENS, MIN_PREFILL_TOKENS, SequenceChunk
from tandem.model.llama import LlamaModel
from tandem.structured import TokenMasker
from tandem.structured.grammar import Matcher


_MASK64 = (1 << 64) - 1
_GOLDEN64 = 0x9E37_79B9_7F4A_7C15


@dataclass(frozen=True, slots=True)
class DraftVocab:
    """A reduced draft head: its rows are the target ids `ids` [N] of a vocabulary of vocab_size."""

    ids: torch.Tensor  # [N] int64
    vocab_size: int
    rows: torch.Tensor  # [vocab_size] int64: each id's head row, -1 outside the draft vocabulary

    @classmethod
    def of(cls, ids: torch.Tensor, vocab_size: int) -> "DraftVocab":
        rows = torch.full((vocab_size,), -1, dtype=torch.int64)
        rows[ids] = torch.arange(len(ids))
        return cls(ids, vocab_size, rows)


@dataclass(slots=True)
class DrawnTokens:
    tokens: list[int]  # [B]
    compressed: list[CompressedProbs | None]  # [B], q' [1, K] for rows that send probabilities
    # [B] lists: each row's most likely tokens other than tokens[b], best first, with the drafter's
    # probability (at temperature 1) that the target emits each if it rejects tokens[b]
    alternatives: list[list[Guess]]


def stack_rows(rows: list[CompressedProbs]) -> CompressedProbs:
    """One CompressedProbs [N, K] from N single-row ones [1, K]."""
    return CompressedProbs(torch.cat([r.ids for r in rows]), torch.cat([r.fixed for r in rows]))


def draw_tokens(logits: torch.Tensor, samplings: list[Sampling], positions: list[int], noise_seeds: list[int],
                probs_top_k: int, draft_vocab: DraftVocab | None = None, alternatives: int = 1) -> DrawnTokens:
    """One draft token per row of logits [B, N], row b being the token at sequence position positions[b].

    Logits cover the vocabulary, or the draft vocabulary of a drafter with a reduced head,
    whose q is zero elsewhere. Greedy rows take the argmax.
    Drafter-invariant rows draw from q with the noise the target shares (`sample`'s default
    TARGET_SALT). The others draw from q' = decode(encode(q)) with the drafter's own salt, keyed by
    noise_seeds[b] (`noise_seed`), and return q' for the wire.
    """
    tokens = top_tokens(logits, draft_vocab)  # [B]
    compressed: list[CompressedProbs | None] = [None] * len(samplings)
    device = logits.device
    invariant = [b for b, s in enumerate(samplings) if not s.greedy and s.drafter_invariant]
    rejection = [b for b, s in enumerate(samplings) if s.needs_draft_probs]
    if invariant or rejection:
        rows = invariant + rejection
        q = probs_of(logits[rows], [samplings[b] for b in rows])  # [S, N]
        if draft_vocab is not None:
            q = _scatter_to_vocabulary(q, draft_vocab)  # [S, V]
        seeds = torch.tensor([samplings[b].seed for b in invariant] + [noise_seeds[b] for b in rejection],
                             dtype=torch.int64, device=device)  # [S]
        pos = torch.tensor([positions[b] for b in rows], dtype=torch.int64, device=device)  # [S]
        drawn = torch.empty_like(seeds)  # [S]
        inv = slice(0, len(invariant))
        rej = slice(len(invariant), len(rows))
        if invariant:
            drawn[inv] = sample(q[inv], seeds[inv], pos[inv])
        if rejection:
            q_prime = encode(q[rej], probs_top_k)  # [R, K]
            drawn[rej] = sample_compressed(q_prime, seeds[rej], pos[rej])
            ids, fixed = q_prime.ids.cpu(), q_prime.fixed.cpu()
            for r, b in enumerate(rejection):
                compressed[b] = CompressedProbs(ids[r : r + 1], fixed[r : r + 1])
        tokens[rows] = drawn
    return DrawnTokens(tokens.tolist(), compressed, _alternatives(logits, tokens, draft_vocab, alternatives))


def noise_seed(seed: int, prefix: list[int]) -> int:
    """The seed (int64) of the drafter's own draws for the drafts that continue `prefix`.

    Keying the noise by the prefix as well as by position keeps the draws of proposals for different
    prefixes independent where their positions overlap, as the pre-drafts of a verification's
    outcomes and the proposal under verification do. Which pre-drafts exist depends on the other
    proposals' drafts (through the outcomes' gains); with noise keyed by position alone, it would
    depend on the pre-draft's own noise (docs/design/speculation-cache.md, Lossless).
    """
    x = (seed ^ (hash(tuple(prefix)) * _GOLDEN64)) & _MASK64  # splitmix64's finalizer
    x = ((x ^ (x >> 30)) * 0xBF58_476D_1CE4_E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D0_49BB_1331_11EB) & _MASK64
    x ^= x >> 31
    return x - (1 << 64) if x >= 1 << 63 else x


def top_tokens(logits: torch.Tensor, draft_vocab: DraftVocab | None = None) -> torch.Tensor:
    """The drafter's most likely token of each row of logits [B, N], as vocabulary ids [B] int64."""
    tokens = logits.argmax(dim=1)
    return tokens if draft_vocab is None else draft_vocab.ids[tokens]


def _alternatives(logits: torch.Tensor, tokens: torch.Tensor, draft_vocab: DraftVocab | None,
                  count: int) -> list[list[Guess]]:
    """Each row's `count` most likely tokens other than tokens[b], with q(t) / (1 - q(tokens[b])):
    the drafter's belief that the target emits t, given that it rejected tokens[b]."""
    width = min(count + 1, logits.shape[1])
    if width < 2:
        return [[] for _ in range(logits.shape[0])]
    probs = torch.softmax(logits.float(), dim=1)  # [B, N]
    top_p, top = probs.topk(width, dim=1)  # [B, width]
    if draft_vocab is not None:
        top = draft_vocab.ids[top]
    head_rows = tokens if draft_vocab is None else draft_vocab.rows[tokens].clamp_min(0)  # [B]
    drawn_p = probs.gather(1, head_rows[:, None])[:, 0]  # [B]
    rest = (1 - drawn_p).clamp_min(1e-6).tolist()
    return [[Guess(t, p / r) for t, p in zip(row, row_p) if t != token][:count]
            for row, row_p, token, r in zip(top.tolist(), top_p.tolist(), tokens.tolist(), rest)]


def _scatter_to_vocabulary(q: torch.Tensor, draft_vocab: DraftVocab) -> torch.Tensor:
    """q [S, N] over the draft vocabulary as [S, V] over the whole vocabulary, zero outside it."""
    full = q.new_zeros(q.shape[0], draft_vocab.vocab_size)
    full[:, draft_vocab.ids] = q
    return full


@dataclass(slots=True)
class Row:
    """One job of a round: the slot it writes into, and what it has drafted so far."""

    job: DraftJob
    state: SlotState
    budget: int
    grammar: Matcher | None = None  # a constrained job's cursor, at the row's last token
    blocked: bool = False  # its grammar allows nothing more (it is complete), or nothing the head can draft
    guessed_next: int | None = None  # the bonus token a guess_next job guessed
    token_ids: list[int] = field(default_factory=list)
    q_rows: list[CompressedProbs] = field(default_factory=list)
    recovered_guesses: list[list[Guess]] = field(default_factory=list)
    _noise_seed: int | None = field(default=None, init=False)

    @property
    def noise_seed(self) -> int:
        """The seed of its draws in rejection mode (0 for rows that draw otherwise), hashed once the
        prefix its drafts continue is known."""
        sampling = self.job.sequence.sampling
        if self._noise_seed is None:
            guessed = [] if self.guessed_next is None else [self.guessed_next]
            self._noise_seed = noise_seed(sampling.seed, self.job.tokens + guessed) if sampling.needs_draft_probs else 0
        return self._noise_seed

    @property
    def guessing(self) -> bool:
        return self.job.guess_next and self.guessed_next is None

    @property
    def position(self) -> int:
        """The position of the token its current logits predict."""
        return self.job.base_len + len(self.token_ids)

    @property
    def context(self) -> list[int]:
        """The tokens its current logits follow."""
        guessed = [] if self.guessed_next is None else [self.guessed_next]
        return self.job.tokens + guessed + self.token_ids

    @property
    def last_token(self) -> int:
        return self.token_ids[-1] if self.token_ids else self.guessed_next

    @property
    def finished(self) -> bool:
        return len(self.token_ids) >= self.budget or self.job.sequence.closed or self.blocked

    def follow_grammar(self, token: int) -> None:
        """Advance the cursor over the row's new token; once the grammar is complete, the row stops."""
        if self.grammar is not None and (not self.grammar.consume_token(token) or self.grammar.is_stopped()):
            self.blocked = True

    def draft(self) -> Drafted:
        q_prime = stack_rows(self.q_rows) if self.q_rows else None
        return make_drafted(self.job, self.token_ids, q_prime, self.recovered_guesses, self.guessed_next)


class ModelDrafter:
    """Drafts with a LlamaModel: one KV slot per open sequence, scratch slots for pre-drafts."""

    kind = "model"
    inline_rounds = False
    feature_layout = None  # it reads no target features

    def __init__(self, model: LlamaModel, probs_top_k: int, metrics: DraftMetrics,
                 draft_vocab: torch.Tensor | None = None, guesses: int = 1, prefix_caching: bool = True,
                 max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS):
        """guesses: the recovered-token guesses each draft carries, for pre-drafting; prefix_caching:
        a closed sequence's slots keep their KV for a new one with the same first tokens;
        max_num_batched_tokens: the tokens a round's catch-up forward runs at most."""
        self.model = model
        self.max_num_batched_tokens = max_num_batched_tokens
        self._behind: list[SeqKey] = []  # the last round's sequences whose catch-up did not end
        self._chunk_next = False  # the last round drafted while a long catch-up waited: the next runs its chunk
        self.guesses = guesses
        vocab_size = model.config.vocab_size
        self.draft_vocab = None if draft_vocab is None else DraftVocab.of(draft_vocab, vocab_size)
        head_rows = vocab_size if draft_vocab is None else len(draft_vocab)
        self.probs_top_k = min(probs_top_k, head_rows)  # encode's K, which Info reports
        self.metrics = metrics
        self.slots = SlotTable(model.kv_cache, prefix_caching)
        self.masker = TokenMasker(vocab_size)

    def open(self, key: SeqKey) -> None:
        self.slots.open(key)

    def close(self, key: SeqKey) -> None:
        self.slots.close(key)

    def settle(self, key: SeqKey, committed: list[int], closing: bool = False) -> None:
        reused = self.slots.settle(key, committed)
        if not closing:  # a closing sequence computes nothing more: the slot kept serves the prefix cache
            self.metrics.reused_tokens.inc(reused)

    def behind(self) -> list[SeqKey]:
        """The sequences whose catch-up the last round ran in part or not at all: nothing was drafted
        for them, and their next round goes on from where their slot's KV ends."""
        return self._behind

    def budget(self, job: DraftJob) -> int:
        """Draft tokens for this job: k, fewer when the slot would overflow (its KV ends at base_len + k - 2)."""
        return min(job.sequence.k, self.model.max_len + 1 - job.base_len)

    @torch.inference_mode()
    def draft(self, jobs: list[DraftJob], stop: Callable[[], bool] = never) -> list[Drafted]:
        rows = self._rows(jobs)
        ends = self._catch_up_ends(rows)
        behind = [row.job.sequence.key for row, end in zip(rows, ends) if end < len(row.job.tokens)]
        rows, logits = self._catch_up(rows, ends)  # logits [B, V] for the rows that caught up
        self._behind = behind
        if not rows:
            return []
        active = rows
        while True:
            self._advance(active, logits)
            active = [row for row in active if not row.finished]
            if not active or stop():
                break
            logits = self._feed(active)  # [len(active), V]
        return [row.draft() for row in rows if not row.job.sequence.closed and row.token_ids]

    def _rows(self, jobs: list[DraftJob]) -> list[Row]:
        """A slot for each job: the sequence's own, or a scratch slot for a pre-draft (left out when none is free)."""
        rows = []
        for job in jobs:
            budget = self.budget(job)
            if budget <= 0 or job.sequence.closed:
                continue
            grammar = None
            if job.sequence.grammar is not None:
                grammar = job.sequence.grammar.cursor(job.tokens)
                if grammar is None:
                    continue  # the grammar allows no token after this prefix
            key = job.sequence.key
            if not job.is_predraft:
                self.slots.adopt(key, job.tokens)
            state = self.slots.scratch_for(key, job.tokens) if job.is_predraft else self.slots.own(key)
            if state is not None:
                rows.append(Row(job, state, budget, grammar))
        return rows

    def _advance(self, rows: list[Row], logits: torch.Tensor) -> None:
        """One token per row from its logits [len(rows), V]: a guess at the bonus token, or a draft."""
        forced = self._take_forced(rows)
        self._mask(rows, logits, forced)
        self._process(rows, logits, forced)
        guessing = [i for i, row in enumerate(rows) if row.guessing and not row.blocked and i not in forced]
        drawing = [i for i, row in enumerate(rows) if not row.guessing and not row.blocked and i not in forced]
        if guessing:
            for i, token in zip(guessing, top_tokens(logits[guessing], self.draft_vocab).tolist()):
                rows[i].guessed_next = token
                rows[i].follow_grammar(token)
        if not drawing:
            return
        everyone = len(drawing) == len(rows)
        drawn = draw_tokens(logits if everyone else logits[drawing],
                            [rows[i].job.sequence.sampling for i in drawing], [rows[i].position for i in drawing],
                            [rows[i].noise_seed for i in drawing], self.probs_top_k, self.draft_vocab, self.guesses)
        for n, i in enumerate(drawing):
            row = rows[i]
            row.token_ids.append(drawn.tokens[n])
            if drawn.compressed[n] is not None:
                row.q_rows.append(drawn.compressed[n])
            row.recovered_guesses.append(drawn.alternatives[n])
            row.follow_grammar(drawn.tokens[n])

    def _take_forced(self, rows: list[Row]) -> set[int]:
        """Where a constrained row's grammar forces the next tokens, take the first as its token, with
        q' = 1 on it: the grammar's own tokenization of forced text, which the target takes far more
        often than another spelling of it, and which a reduced head may not even hold.
        Returns the indices of the rows that took one."""
        taken = set()
        for i, row in enumerate(rows):
            if row.grammar is None or row.blocked or not (forced := row.grammar.compute_ff_tokens()):
                continue
            if row.guessing:
                row.guessed_next = forced[0]
            else:
                row.token_ids.append(forced[0])
                if row.job.sequence.sampling.needs_draft_probs:
                    row.q_rows.append(point_mass([forced[0]], self.probs_top_k))
                row.recovered_guesses.append([])
            taken.add(i)
            row.follow_grammar(forced[0])
        return taken

    def _mask(self, rows: list[Row], logits: torch.Tensor, forced: set[int]) -> None:
        """In place: -inf where a constrained row's grammar forbids the token. A row left with no
        token its head can draft is blocked. Rows whose token was forced are left alone, and
        unconstrained batches skip this altogether."""
        constrained = [i for i, row in enumerate(rows)
                       if row.grammar is not None and not row.blocked and i not in forced]
        if not constrained:
            return
        bitmask = self.masker.fill([(rows[i].grammar, []) for i in constrained])  # [C, W]
        allowed = allowed_tokens(bitmask, self.masker.vocab_size).to(logits.device)  # [C, V]
        if self.draft_vocab is not None:
            allowed = allowed[:, self.draft_vocab.ids]  # [C, N]
        forbidden = ~allowed
        for n, (i, any_allowed) in enumerate(zip(constrained, allowed.any(dim=1).tolist())):
            logits[i].masked_fill_(forbidden[n], float("-inf"))
            rows[i].blocked |= not any_allowed

    def _process(self, rows: list[Row], logits: torch.Tensor, forced: set[int]) -> None:
        """In place: the target's logits rules (penalties, bias, bans) on the rows whose request has
        them, each counting its own drafts, so that drafts and q' guess the target's p. A reduced
        head's rows are processed over the whole vocabulary, -inf outside the head. A row the rules
        leave no token is blocked."""
        ruled = []
        for i, row in enumerate(rows):
            if not row.blocked and i not in forced:
                context = row.job.sequence.logits_context(row.context)
                if context is not None:
                    ruled.append((i, row.job.sequence.sampling, context))
        if not ruled:
            return
        index = torch.tensor([i for i, _, _ in ruled], device=logits.device)
        if self.draft_vocab is None:
            process_logits(logits, ruled)
        else:
            full = logits.new_full((len(ruled), self.draft_vocab.vocab_size), float("-inf"))  # [R, V]
            full[:, self.draft_vocab.ids] = logits[index]
            process_logits(full, [(n, sampling, context) for n, (_, sampling, context) in enumerate(ruled)])
            logits[index] = full[:, self.draft_vocab.ids]
        for (i, _, _), alive in zip(ruled, torch.isfinite(logits[index]).any(dim=1).tolist()):
            rows[i].blocked |= not alive

    def _catch_up_start(self, row: Row) -> int:
        """Where the row's catch-up starts: after the tokens its slot holds, at its last token at the latest
        (its logits give the next one)."""
        state, tokens = row.state, row.job.tokens
        return min(common_prefix_len(state.cached, tokens, likely=state.committed_len), len(tokens) - 1)

    def _catch_up_ends(self, rows: list[Row]) -> list[int]:
        """Where each row's catch-up ends this round. The shortest go first, whole while they fit in
        max_num_batched_tokens; pre-drafts, a few tokens, always run whole. When the rest do not fit
        (a long prompt), rounds take turns: one drafts the rows that fit while the others wait; the
        next runs only those others, the furthest prefilled first (then in the round's order, where
        those left behind come first), whole while they fit and the last in part, and the rows that
        fit wait for the round after. So no draft waits for a chunk's forward, and a prompt once
        begun goes on until it is done; with nothing else to draft, every round runs chunks."""
        starts = [self._catch_up_start(row) for row in rows]
        ends = [len(row.job.tokens) for row in rows]
        room = self.max_num_batched_tokens - sum(e - s for row, s, e in zip(rows, starts, ends) if row.job.is_predraft)
        left, fit, long = room, [], []
        fresh = [b for b, row in enumerate(rows) if not row.job.is_predraft]
        for b in sorted(fresh, key=lambda b: ends[b] - starts[b]):
            if not long and ends[b] - starts[b] <= left:
                fit.append(b)
                left -= ends[b] - starts[b]
            else:
                long.append(b)
        if not long:
            return ends
        chunk_turn = self._chunk_next or not fit
        self._chunk_next = not chunk_turn
        if not chunk_turn:
            for b in long:
                ends[b] = starts[b]
            return ends
        for b in fit:
            ends[b] = starts[b]
        left = max(room, MIN_PREFILL_TOKENS)  # the first always makes progress
        for b in sorted(long, key=lambda b: (-starts[b], b)):
            take = min(ends[b] - starts[b], left) if left >= MIN_PREFILL_TOKENS else 0
            ends[b] = starts[b] + take
            left -= take
        return ends

    def _catch_up(self, rows: list[Row], ends: list[int]) -> tuple[list[Row], torch.Tensor]:
        """Feed each row's tokens that its slot lacks, up to its end this round; returns the rows
        that caught up, with logits [B, V] at each one's last position (the others' go unread)."""
        caught_up, finishing, partial, ran = [], [], [], []
        prefills = False
        for row, end in zip(rows, ends):
            state, job = row.state, row.job
            start = self._catch_up_start(row)
            if end == start:  # waits for a later round
                continue
            if not job.is_predraft:  # a pre-draft's assumed tokens are not committed ones
                self._count_reuse(job, state, start)
                prefills |= start < job.sequence.prompt_len
            state.cached = job.tokens[:start]  # until the forward has written the rest
            ran.append((row, end))
            if end == len(job.tokens):
                caught_up.append(row)
                finishing.append(SequenceChunk(state.slot, start, job.tokens[start:end]))
            else:
                partial.append(SequenceChunk(state.slot, start, job.tokens[start:end]))
        if not ran:
            return [], torch.empty(0)
        began = time.perf_counter()
        logits = self.model.run(finishing + partial)[:len(finishing)]  # [B, V]; the partial rows go unread
        if prefills:
            self.metrics.prefill_duration.observe(time.perf_counter() - began)
        for row, end in ran:
            row.state.cached = row.job.tokens[:end]
            # A part's end is committed, with nothing drafted past it: the next round's reuse counts from there.
            row.state.committed_len = row.job.known_len if end == len(row.job.tokens) else end
        return caught_up, logits

    def _count_reuse(self, job: DraftJob, state: SlotState, start: int) -> None:
        """KV not recomputed: on a sequence's first catch-up (nothing committed yet) what the prefix cache
        held, later what earlier drafts computed."""
        if state.committed_len == 0:
            self.metrics.prefix_cache_queries.inc(len(job.tokens))
            self.metrics.prefix_cache_hits.inc(start)
        else:
            self.metrics.reused_tokens.inc(max(0, start - state.committed_len))

    def _feed(self, rows: list[Row]) -> torch.Tensor:
        """Write each row's latest token into its slot; logits [B, V] for the next draft."""
        chunks = [SequenceChunk(row.state.slot, len(row.state.cached), [row.last_token]) for row in rows]
        logits = self.model.run(chunks)
        for row in rows:
            row.state.cached.append(row.last_token)
        return logits
