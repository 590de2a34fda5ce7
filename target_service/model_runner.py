"""The model work of one target step, run on the executor thread over snapshots of sequence state.

A step hands the runner Chunks (step_items.py), one per sequence, and they run in one forward.
A sequence with committed tokens x[0..n-1] whose slot holds KV for the first c of them runs
x[c..n-1] at positions c..n-1, then its drafts d1..dk: the rows of x[n-1] and of the drafts give
k+1 rows of p, and the step emits the accepted drafts plus one recovered or bonus token. The same
rule serves every chunk that samples:
  - a prompt's last chunk: c is what the prefix cache or earlier chunks left, k = 0, and the one
    token is the first, sampled at position len(prompt);
  - a running sequence: c = n - 1, or less when it is back from a preemption (the committed tokens
    its slot lacks run again in front, `replayed`); k = 0 is a plain decode step.
A long prompt's earlier chunks (chunked prefill) write their KV and sample nothing. A prompt whose
logprobs are asked for keeps the rows of every position, which score its own tokens. The other
samples of a request (n > 1) run nothing: they copy the first sample's prompt KV into their slots
and sample the same logits row with their own seeds.

Structured output: a constrained sequence's k + 1 logits rows are masked by its grammar (at its
state, then after d1, d1 d2, ...) before p is built, so greedy picks, rejection sampling and the
recovered and bonus tokens all use the target's constrained distribution. A draft the grammar
forbids has p = 0 and is rejected. The masks are computed on their own thread during the forward.

Logits rules (penalties, logit_bias, allowed tokens, bad words, the min_tokens ban): a chunk with a
logits context has its rows processed the same way, row i counting d1..di as generated
(tandem_kernels/logits_processors.py), so p at every row is what the target alone samples from.
"""
from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace

import torch

from tandem_kernels.bitmask import allowed_tokens, apply_forbidden, apply_token_bitmask
from tandem_kernels.compression import CompressedProbs, concat, no_probs
from tandem_kernels.gumbel import verify_invariant
from tandem_kernels.logits_processors import process_logits
from tandem_kernels.logprobs import TokenLogprob, row_logprobs, sequence_logprobs, token_logprobs
from tandem_kernels.ragged import VerifyBatch
from tandem_kernels.rejection import rejection_sample
from tandem_kernels.sampling import Sampling, probs_of
from target_service.metrics import TargetMetrics
from target_service.step_items import Chunk, ChunkResult
from tandem.model.batch import SequenceChunk
from tandem.model.llama import LlamaModel
from tandem.structured import TokenMasker
from tandem.structured.grammar import Matcher


# What turns a forward's rows (final hidden states) into logits; None: the rows are logits already.
ToLogits = Callable[[torch.Tensor], torch.Tensor] | None

class ModelRunner:
    def __init__(self, model: LlamaModel, metrics: TargetMetrics | None = None):
        self.model = model
        self.device = model.device
        self.vocab_size = model.config.vocab_size
        self.metrics = metrics
        self.masker = TokenMasker(self.vocab_size)
        self._mask_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="target-masks")

    @torch.inference_mode()
    def warm_up(self) -> None:
        """One prefill, decode and verify before serving, so the first request pays no one-time costs."""
        slot = self.model.kv_cache.allocate()
        try:
            self.model.run([SequenceChunk(slot=slot, start=0, token_ids=[0] * 32)])
            self.model.run([SequenceChunk(slot=slot, start=32, token_ids=[0])])
            self.model.run([SequenceChunk(slot=slot, start=33, token_ids=[0] * 5, num_logits=5)])
        finally:
            self.model.kv_cache.free(slot)

    @torch.inference_mode()
    def run(self, chunks: list[Chunk], capture: tuple[int, ...] = ()) -> list[ChunkResult]:
        """Each chunk's result, in order: a sampling chunk's tokens (its accepted drafts, then one
        more), an earlier prompt chunk's none; with the prompt logprobs asked for, and with capture,
        the features of these target layers (ChunkResult.features)."""
        runs = [b for b, c in enumerate(chunks) if c.copy_of is None]  # the chunks whose tokens run
        sampling = [b for b, c in enumerate(chunks) if c.samples]
        masks = self._start_masks([(chunks[b].grammar, chunks[b].draft_tokens) for b in sampling])  # during the forward
        rows, features, to_logits = self._forward_rows([chunks[b] for b in runs], capture)
        scored = dict(zip(runs, _prompt_logprobs(rows, [chunks[b] for b in runs], to_logits)))
        features_of = dict(zip(runs, features))
        verified: dict[int, ChunkResult] = {}
        if sampling:
            self._share_prompts([chunks[b] for b in sampling], chunks)
            logits = _rows_at(rows, _sampled_rows(chunks, runs, sampling), to_logits)  # [sum(k_i + 1), vocab]
            verified = dict(zip(sampling, self._verify([chunks[b] for b in sampling], logits, masks)))
        results = []
        for b, chunk in enumerate(chunks):
            result = verified.get(b) or ChunkResult([], 0)
            own, prompt_logprobs = features_of.get(b if chunk.copy_of is None else chunk.copy_of), scored.get(b)
            if own is not None or prompt_logprobs is not None:
                result = replace(result, prompt_logprobs=prompt_logprobs,
                                 features=None if own is None else own[chunk.replayed:])
            results.append(result)
        return results

    def _share_prompts(self, sampling: list[Chunk], chunks: list[Chunk]) -> None:
        """Each copy (another sample of a prompt that ran) takes the KV of the chunk it copies."""
        for chunk in sampling:
            if chunk.copy_of is not None:
                self.model.kv_cache.share_prefix(chunks[chunk.copy_of].slot, chunk.slot, chunk.end)

    def _forward_rows(self, runs: list[Chunk], capture: tuple[int, ...]
                      ) -> tuple[torch.Tensor, list[torch.Tensor | None], ToLogits]:
        """The chunks' rows, their features, and what turns the rows into logits: None when they
        are logits already; the final norm and LM head when some prompt's logprobs are asked (and no
        features), so that a long prompt's rows become logits a slice at a time."""
        chunks = [c.forward for c in runs]
        if capture or all(c.prompt_logprobs is None for c in runs):
            return *self._forward(chunks, capture), None  # logits [sum(num_logits), vocab]
        hidden = self.model.final_hidden(self.model.build_batch(chunks))  # [sum(num_logits), hidden]
        return hidden, [None] * len(chunks), self.model.logits

    def _verify(self, chunks: list[Chunk], logits: torch.Tensor,
                masks: tuple[Future, list[int]] | None) -> list[ChunkResult]:
        """Each sampling chunk's tokens from its rows of logits [sum(k_i + 1), vocab]: its drafts
        accepted by the rule of its sampling, then the recovered or bonus token."""
        firsts = self._first_rows(chunks)
        raw = _raw_rows(logits, list(zip(firsts, chunks)), [c.num_drafts + 1 for c in chunks])  # before masks, rules
        self._apply_masks(logits, masks)
        _process_logits(logits, list(zip(firsts, chunks)))
        results: list[ChunkResult | None] = [None] * len(chunks)
        greedy = [b for b, c in enumerate(chunks) if c.sampling.greedy]
        rows = self._rows_of(chunks, greedy)
        targets = iter(self._greedy_tokens(logits, rows, logits.shape[0]))
        for b in greedy:
            results[b] = verify_greedy(chunks[b].draft_tokens, [next(targets) for _ in range(chunks[b].num_drafts + 1)])
        invariant = [b for b, c in enumerate(chunks) if not c.sampling.greedy and c.sampling.drafter_invariant]
        standard = [b for b, c in enumerate(chunks) if c.sampling.needs_draft_probs]
        for group, verify in ((standard, self._rejection), (invariant, self._invariant)):
            if group:
                group_rows = self._long(self._rows_of(chunks, group))
                probs = probs_of(logits[group_rows], [chunks[b].sampling for b in group
                                                      for _ in range(chunks[b].num_drafts + 1)])
                for b, verified in zip(group, verify([chunks[b] for b in group], probs)):
                    results[b] = verified
        return _with_logprobs(results, raw)

    def _forward(self, chunks: list[SequenceChunk], capture: tuple[int, ...]
                 ) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """Logits at the chunks' logits rows, and per chunk its features [len, layers, hidden] bf16
        when capture names layers (else Nones)."""
        batch = self.model.build_batch(chunks)
        if not capture:
            return self.model.forward(batch), [None] * len(chunks)
        logits, features = self.model.forward_capturing(batch, capture)  # features [T, layers, hidden]
        per_chunk = features.to(torch.bfloat16).split([len(c.token_ids) for c in chunks])
        return logits, list(per_chunk)

    def _start_masks(self, rows: list[tuple[Matcher | None, tuple[int, ...]]]) -> tuple[Future, list[int]] | None:
        """Start computing the bitmasks of the constrained chunks, each (grammar, drafts) owning
        len(drafts) + 1 logits rows; returns the pending masks and the logits rows they cover."""
        jobs, covered, offset = [], [], 0
        for grammar, drafts in rows:
            if grammar is not None:
                jobs.append((grammar, list(drafts)))
                covered.extend(range(offset, offset + len(drafts) + 1))
            offset += len(drafts) + 1
        if not jobs:
            return None
        return self._mask_thread.submit(self._timed_fill, jobs), covered

    def _timed_fill(self, jobs: list[tuple[Matcher, list[int]]]) -> torch.Tensor:
        """The bitmask [R, W]; on CPU already unpacked to forbidden tokens [R, V], off the critical path."""
        started = time.perf_counter()
        masks = self.masker.fill(jobs)
        if self.device.type == "cpu":
            masks = ~allowed_tokens(masks, self.vocab_size)
        if self.metrics is not None:
            self.metrics.grammar_mask.observe(time.perf_counter() - started)
        return masks

    def _apply_masks(self, logits: torch.Tensor, masks: tuple[Future, list[int]] | None) -> None:
        if masks is None:
            return
        pending, rows = masks
        if self.device.type == "cpu":
            apply_forbidden(logits, pending.result(), rows)
        else:
            apply_token_bitmask(logits, pending.result(), self._long(rows))

    def _greedy_tokens(self, logits: torch.Tensor, rows: list[int], total: int) -> list[int]:
        """argmax p of the given rows of logits: greedy rows skip building p altogether."""
        if not rows:
            return []
        return self.model.greedy_tokens(logits if len(rows) == total else logits[self._long(rows)])

    def _rejection(self, chunks: list[Chunk], probs: torch.Tensor) -> list[ChunkResult]:
        greedy = torch.tensor([c.sampling.greedy for c in chunks], dtype=torch.bool, device=self.device)
        result = rejection_sample(self._verify_batch(chunks, probs), self._draft_probs(chunks), greedy)
        return _unpack(result.tokens, result.num_accepted)

    def _invariant(self, chunks: list[Chunk], probs: torch.Tensor) -> list[ChunkResult]:
        result = verify_invariant(self._verify_batch(chunks, probs))
        return _unpack(result.tokens, result.num_accepted)

    def _verify_batch(self, chunks: list[Chunk], probs: torch.Tensor) -> VerifyBatch:
        """The kernels' view of the chunks: p [rows, V], the drafts, and where each chunk's rows are keyed."""
        return VerifyBatch(
            probs,
            self._long([t for c in chunks if c.drafts for t in c.drafts.tokens]),
            torch.cumsum(self._long([c.num_drafts for c in chunks]), dim=0),
            self._seeds([c.sampling for c in chunks]),
            self._long([c.end for c in chunks]),
        )

    def _draft_probs(self, chunks: list[Chunk]) -> CompressedProbs:
        """q' rows for every draft, [D, K]; drafts verified by ids alone get empty rows."""
        parts = [c.drafts.probs if c.drafts.probs is not None else no_probs(c.num_drafts) for c in chunks if c.drafts]
        merged = concat(parts)
        return CompressedProbs(merged.ids.to(self.device), merged.fixed.to(self.device))

    def _rows_of(self, chunks: list[Chunk], group: list[int]) -> list[int]:
        """The logits rows of the chunks in group: k + 1 per chunk."""
        starts = self._first_rows(chunks)
        return [r for b in group for r in range(starts[b], starts[b] + chunks[b].num_drafts + 1)]

    @staticmethod
    def _first_rows(chunks: list[Chunk]) -> list[int]:
        """Each chunk's first logits row: the rows before it are k + 1 per chunk."""
        starts, offset = [], 0
        for chunk in chunks:
            starts.append(offset)
            offset += chunk.num_drafts + 1
        return starts

    def _seeds(self, samplings: list[Sampling]) -> torch.Tensor:
        return self._long([s.seed for s in samplings])

    def _long(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)


def verify_greedy(drafts: tuple[int, ...], targets: list[int]) -> ChunkResult:
    """Greedy verification: accept drafts while each equals the target's argmax at its position,
    then emit the argmax after the last accepted one (recovered or bonus token).
    targets: argmax p at the k + 1 verified positions. Same rule as tandem_kernels.rejection's greedy rows."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == targets[accepted]:
        accepted += 1
    return ChunkResult(tokens=[*drafts[:accepted], targets[accepted]], num_accepted=accepted)


def _process_logits(logits: torch.Tensor, chunks: list[tuple[int, Chunk]]) -> None:
    """In place, logits [rows, vocab]: the rules of each chunk with a logits context, from its first row on."""
    ruled = [(first, c.sampling, c.logits_context) for first, c in chunks if c.logits_context is not None]
    if ruled:
        process_logits(logits, ruled)


def _prompt_logprobs(rows: torch.Tensor, runs: list[Chunk],
                     to_logits: ToLogits) -> list[list[TokenLogprob] | None]:
    """From rows [sum(num_logits), ...] (logits, or what to_logits turns into logits), the logprobs
    of the prompt tokens each run scores, for those that asked (row j scores the token after it)."""
    if all(run.prompt_logprobs is None for run in runs):
        return [None] * len(runs)
    prompts: list[list[TokenLogprob] | None] = []
    start = 0
    for run in runs:
        scored = rows[start:start + len(run.scored)]
        prompts.append(None if run.prompt_logprobs is None else
                       sequence_logprobs(scored, list(run.scored), run.prompt_logprobs, to_logits))
        start += run.num_logits
    return prompts


def _sampled_rows(chunks: list[Chunk], runs: list[int], sampling: list[int]) -> list[int] | None:
    """The forward's rows each sampling chunk verifies, in order: the last 1 + k of its run's rows
    (its newest token's, then its drafts'); a copy's are those of the chunk it copies. None when
    that is every row, in order (a verify step, or prompts that end with no copies or logprobs)."""
    if all(c.samples and c.copy_of is None and c.prompt_logprobs is None for c in chunks):
        return None
    first_row = dict(zip(runs, itertools.accumulate((chunks[b].num_logits for b in runs), initial=0)))
    rows = []
    for b in sampling:
        source = b if chunks[b].copy_of is None else chunks[b].copy_of
        end = first_row[source] + chunks[source].num_logits
        rows.extend(range(end - 1 - chunks[b].num_drafts, end))
    return rows


def _rows_at(rows: torch.Tensor, index: list[int] | None, to_logits: ToLogits) -> torch.Tensor:
    """The logits at these rows of the forward's rows (logits, or what to_logits turns into them);
    index None: every row, the rows themselves and not a copy."""
    picked = rows if index is None else rows[torch.tensor(index, dtype=torch.int64).to(rows.device)]
    return picked if to_logits is None else to_logits(picked)


@dataclass(frozen=True, slots=True)
class RawRows:
    """The raw logits rows of the chunks that asked for logprobs, as the forward left them: a view of
    the step's logits, or a copy for a chunk whose rows a grammar or logits rules change in place."""

    rows: dict[int, torch.Tensor]  # chunk -> its rows [k + 1, V]
    top_n: dict[int, int]  # chunk -> the top alternatives it asked for


def _raw_rows(logits: torch.Tensor, chunks: list[tuple[int, Chunk]],
              counts: list[int]) -> RawRows | None:
    """Before any processing: the rows of the chunks that ask for logprobs, kept as they are."""
    rows, top_n = {}, {}
    for b, (first, chunk) in enumerate(chunks):
        if chunk.logprobs is None:
            continue
        view = logits[first : first + counts[b]]
        rows[b] = view.clone() if chunk.grammar is not None or chunk.logits_context is not None else view
        top_n[b] = chunk.logprobs
    return RawRows(rows, top_n) if rows else None


def _with_logprobs(results: list[ChunkResult], raw: RawRows | None) -> list[ChunkResult]:
    """The results with each emitted token's log-probability: a chunk's token j was drawn at its row j.
    Only the emitted rows are scored: a verify's rejected drafts cost nothing."""
    if raw is None:
        return results
    parts, tokens, top_n = [], [], []
    for b, rows in raw.rows.items():
        emitted = results[b].tokens
        parts.append(rows[: len(emitted)])
        tokens += emitted
        top_n += [raw.top_n[b]] * len(emitted)
    scored = row_logprobs(parts[0] if len(parts) == 1 else torch.cat(parts), max(top_n))  # [T, V]
    logprobs = iter(token_logprobs(scored, list(range(len(tokens))), tokens, top_n))
    return [replace(r, logprobs=[next(logprobs) for _ in r.tokens]) if b in raw.rows else r
            for b, r in enumerate(results)]


def _unpack(tokens: torch.Tensor, num_accepted: torch.Tensor) -> list[ChunkResult]:
    """One host sync for the whole batch."""
    rows, counts = tokens.tolist(), num_accepted.tolist()
    return [ChunkResult(tokens=row[: n + 1], num_accepted=n) for row, n in zip(rows, counts)]
