"""The model work of one target step, run on the executor thread over snapshots of sequence state.

Prefill: each new prompt is run and its first token sampled at position len(prompt); a prompt whose
logprobs are asked for keeps the logits of every position, which score its own tokens. A long
prompt may run in parts over several steps (`PromptPart`, chunked prefill): a part writes its KV,
samples nothing, and scores its tokens the same way. The other
samples of a request (n > 1) run nothing: they copy the first sample's prompt KV into their slots
and sample the same logits row with their own seeds.
Verify: a sequence with committed tokens x[0..n-1] has KV for n-1 of them; it runs
[x[n-1], d1..dk] at positions n-1..n-1+k, so k+1 rows of p, and emits accepted drafts plus one
recovered or bonus token. With no drafts (k = 0) this is a plain decode step. A sequence back from
a preemption runs the committed tokens its slot lacks in front, in the same chunk (`replay`).

Structured output: a constrained sequence's k + 1 logits rows are masked by its grammar (at its
state, then after d1, d1 d2, ...) before p is built, so greedy picks, rejection sampling and the
recovered and bonus tokens all use the target's constrained distribution. A draft the grammar
forbids has p = 0 and is rejected. The masks are computed on their own thread during the forward.

Logits rules (penalties, logit_bias, allowed tokens, bad words, the min_tokens ban): an item with a
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
from tandem_kernels.sampling import Sampling, probs_of, sample
from target_service.metrics import TargetMetrics
from target_service.step_items import ItemResult, PrefillItem, PromptPart, VerifyItem
from tandem.model.batch import SequenceChunk
from tandem.model.llama import LlamaModel
from tandem.structured import TokenMasker
from tandem.structured.grammar import Matcher


# What turns a prefill's rows (final hidden states) into logits; None: the rows are logits already.
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
    def prefill(self, items: list[PrefillItem], capture: tuple[int, ...] = (),
                parts: list[PromptPart] = ()) -> list[ItemResult]:
        """Each item's first token; capture: also the features of these target layers (ItemResult.features).

        parts: earlier parts of longer prompts, run in the same forward; after the items' results
        comes one per part, with no token (and its features and prompt logprobs, when asked)."""
        runs = [b for b, i in enumerate(items) if i.copy_of is None]  # the items whose prompts run
        chunks = [SequenceChunk(slot=items[b].slot, start=items[b].cached, token_ids=items[b].prompt_ids[items[b].cached:],
                                num_logits=items[b].num_logits) for b in runs]
        masks = self._start_masks([(i.grammar, ()) for i in items])  # computed during the forward
        scoring = [items[b] for b in runs] + list(parts)  # in the order of their rows
        rows, features, to_logits = self._prefill_forward(chunks + [p.chunk for p in parts], capture, scoring)
        num_rows = sum(c.num_logits for c in chunks)  # the parts' rows come after these
        parts_scored = _prompt_logprobs(rows[num_rows:], list(parts), to_logits)
        part_results = [ItemResult([], 0, f, prompt_logprobs=scored)
                        for f, scored in zip(features[len(chunks):], parts_scored, strict=True)]
        if not chunks:
            return part_results
        rows, features = rows[:num_rows], features[:len(chunks)]
        prompt_logprobs = _prompt_logprobs(rows, [items[b] for b in runs], to_logits)
        logits = _last_rows(rows, [items[b] for b in runs], to_logits)  # [runs, vocab]
        if len(runs) < len(items):  # samples of one prompt: its KV shared, its row repeated
            run_of = {b: r for r, b in enumerate(runs)}
            rows = [run_of[b if i.copy_of is None else i.copy_of] for b, i in enumerate(items)]
            for item in items:
                if item.copy_of is not None:
                    self.model.kv_cache.share_prefix(items[item.copy_of].slot, item.slot, len(item.prompt_ids))
            logits = logits[self._long(rows)]  # [B, vocab]
            features = [features[r] for r in rows]
            prompt_logprobs = [prompt_logprobs[run_of[b]] if b in run_of else None for b in range(len(items))]
        raw = _raw_rows(logits, list(enumerate(items)), [1] * len(items))  # before masks and rules
        self._apply_masks(logits, masks)
        _process_logits(logits, [(b, i) for b, i in enumerate(items)])
        tokens = [0] * len(items)
        greedy = [b for b, i in enumerate(items) if i.sampling.greedy]
        sampled = [b for b, i in enumerate(items) if not i.sampling.greedy]
        for b, token in zip(greedy, self._greedy_tokens(logits, greedy, len(items))):
            tokens[b] = token
        if sampled:
            samplings = [items[b].sampling for b in sampled]
            probs = probs_of(logits[self._long(sampled)], samplings)
            positions = self._long([len(items[b].prompt_ids) for b in sampled])
            for b, token in zip(sampled, sample(probs, self._seeds(samplings), positions).tolist()):
                tokens[b] = token
        return _with_logprobs([ItemResult([token], 0, rows, prompt_logprobs=prompt)
                               for token, rows, prompt in zip(tokens, features, prompt_logprobs)], raw) + part_results

    def _prefill_forward(self, chunks: list[SequenceChunk], capture: tuple[int, ...],
                         scoring: list[PrefillItem | PromptPart]) -> tuple[torch.Tensor, list[torch.Tensor | None], ToLogits]:
        """The chunks' rows, their features, and what turns the rows into logits: None when they
        are logits already; the final norm and LM head when some prompt's logprobs are asked (and no
        features), so that a long prompt's rows become logits a slice at a time."""
        if capture or all(s.prompt_logprobs is None for s in scoring):
            return *self._forward(chunks, capture), None  # logits [sum(num_logits), vocab]
        hidden = self.model.final_hidden(self.model.build_batch(chunks))  # [sum(num_logits), hidden]
        return hidden, [None] * len(chunks), self.model.logits

    @torch.inference_mode()
    def verify(self, items: list[VerifyItem], capture: tuple[int, ...] = ()) -> list[ItemResult]:
        chunks = [
            SequenceChunk(
                slot=i.slot,
                start=i.length - 1 - len(i.replay),
                token_ids=[*i.replay, i.last_token, *(i.drafts.tokens if i.drafts else ())],
                num_logits=i.num_drafts + 1,
            )
            for i in items
        ]
        masks = self._start_masks([(i.grammar, i.drafts.tokens if i.drafts else ()) for i in items])
        logits, features = self._forward(chunks, capture)  # [sum(k_i + 1), vocab]
        firsts = self._first_rows(items)
        raw = _raw_rows(logits, list(zip(firsts, items)), [i.num_drafts + 1 for i in items])  # before masks, rules
        self._apply_masks(logits, masks)
        _process_logits(logits, list(zip(firsts, items)))
        results: list[ItemResult | None] = [None] * len(items)
        greedy = [b for b, i in enumerate(items) if i.sampling.greedy]
        rows = self._rows_of(items, greedy)
        targets = iter(self._greedy_tokens(logits, rows, logits.shape[0]))
        for b in greedy:
            results[b] = verify_greedy(items[b].drafts.tokens if items[b].drafts else (),
                                       [next(targets) for _ in range(items[b].num_drafts + 1)])
        invariant = [b for b, i in enumerate(items) if not i.sampling.greedy and i.sampling.drafter_invariant]
        standard = [b for b, i in enumerate(items) if i.sampling.needs_draft_probs]
        for group, verify in ((standard, self._rejection), (invariant, self._invariant)):
            if group:
                group_rows = self._long(self._rows_of(items, group))
                probs = probs_of(logits[group_rows], [items[b].sampling for b in group
                                                      for _ in range(items[b].num_drafts + 1)])
                for b, verified in zip(group, verify([items[b] for b in group], probs)):
                    results[b] = verified
        if capture:  # the replayed rows' features were sent when those tokens were first committed
            results = [ItemResult(r.tokens, r.num_accepted, rows[len(i.replay):])
                       for r, rows, i in zip(results, features, items)]
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
        """Start computing the bitmasks of the constrained items, each (grammar, drafts) owning
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

    def _rejection(self, items: list[VerifyItem], probs: torch.Tensor) -> list[ItemResult]:
        greedy = torch.tensor([i.sampling.greedy for i in items], dtype=torch.bool, device=self.device)
        result = rejection_sample(self._verify_batch(items, probs), self._draft_probs(items), greedy)
        return _unpack(result.tokens, result.num_accepted)

    def _invariant(self, items: list[VerifyItem], probs: torch.Tensor) -> list[ItemResult]:
        result = verify_invariant(self._verify_batch(items, probs))
        return _unpack(result.tokens, result.num_accepted)

    def _verify_batch(self, items: list[VerifyItem], probs: torch.Tensor) -> VerifyBatch:
        """The kernels' view of the items: p [rows, V], the drafts, and where each item's rows are keyed."""
        return VerifyBatch(
            probs,
            self._long([t for i in items if i.drafts for t in i.drafts.tokens]),
            torch.cumsum(self._long([i.num_drafts for i in items]), dim=0),
            self._seeds([i.sampling for i in items]),
            self._long([i.length for i in items]),
        )

    def _draft_probs(self, items: list[VerifyItem]) -> CompressedProbs:
        """q' rows for every draft, [D, K]; drafts verified by ids alone get empty rows."""
        parts = [i.drafts.probs if i.drafts.probs is not None else no_probs(i.num_drafts) for i in items if i.drafts]
        merged = concat(parts)
        return CompressedProbs(merged.ids.to(self.device), merged.fixed.to(self.device))

    def _rows_of(self, items: list[VerifyItem], group: list[int]) -> list[int]:
        """The logits rows of the items in group: k + 1 per item."""
        starts = self._first_rows(items)
        return [r for b in group for r in range(starts[b], starts[b] + items[b].num_drafts + 1)]

    @staticmethod
    def _first_rows(items: list[VerifyItem]) -> list[int]:
        """Each item's first logits row: the rows before it are k + 1 per item."""
        starts, offset = [], 0
        for item in items:
            starts.append(offset)
            offset += item.num_drafts + 1
        return starts

    def _seeds(self, samplings: list[Sampling]) -> torch.Tensor:
        return self._long([s.seed for s in samplings])

    def _long(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)


def verify_greedy(drafts: tuple[int, ...], targets: list[int]) -> ItemResult:
    """Greedy verification: accept drafts while each equals the target's argmax at its position,
    then emit the argmax after the last accepted one (recovered or bonus token).
    targets: argmax p at the k + 1 verified positions. Same rule as tandem_kernels.rejection's greedy rows."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == targets[accepted]:
        accepted += 1
    return ItemResult(tokens=[*drafts[:accepted], targets[accepted]], num_accepted=accepted)


def _process_logits(logits: torch.Tensor, items: list[tuple[int, PrefillItem | VerifyItem]]) -> None:
    """In place, logits [rows, vocab]: the rules of each item with a logits context, from its first row on."""
    ruled = [(first, i.sampling, i.logits_context) for first, i in items if i.logits_context is not None]
    if ruled:
        process_logits(logits, ruled)


def _prompt_logprobs(rows: torch.Tensor, runs: list[PrefillItem] | list[PromptPart],
                     to_logits: ToLogits) -> list[list[TokenLogprob] | None]:
    """From rows [sum(num_logits), ...] (logits, or what to_logits turns into logits), the logprobs
    of the prompt tokens each run scores, for those that asked (row j scores the token after it)."""
    prompts: list[list[TokenLogprob] | None] = []
    start = 0
    for run in runs:
        scored = rows[start:start + len(run.scored)]
        prompts.append(None if run.prompt_logprobs is None else
                       sequence_logprobs(scored, run.scored, run.prompt_logprobs, to_logits))
        start += run.num_logits
    return prompts


def _last_rows(rows: torch.Tensor, items: list[PrefillItem],
               to_logits: ToLogits) -> torch.Tensor:
    """Each item's last row of logits [B, vocab], from which its first token is sampled."""
    last = rows
    if any(i.num_logits > 1 for i in items):
        ends = torch.tensor(list(itertools.accumulate(i.num_logits for i in items)), dtype=torch.int64)
        last = rows[(ends - 1).to(rows.device)]
    return last if to_logits is None else to_logits(last)


@dataclass(frozen=True, slots=True)
class RawRows:
    """The raw logits rows of the items that asked for logprobs, as the forward left them: a view of
    the step's logits, or a copy for an item whose rows a grammar or logits rules change in place."""

    rows: dict[int, torch.Tensor]  # item -> its rows [k + 1, V] (a prefill's: [1, V])
    top_n: dict[int, int]  # item -> the top alternatives it asked for


def _raw_rows(logits: torch.Tensor, items: list[tuple[int, PrefillItem | VerifyItem]],
              counts: list[int]) -> RawRows | None:
    """Before any processing: the rows of the items that ask for logprobs, kept as they are."""
    rows, top_n = {}, {}
    for b, (first, item) in enumerate(items):
        if item.logprobs is None:
            continue
        view = logits[first : first + counts[b]]
        rows[b] = view.clone() if item.grammar is not None or item.logits_context is not None else view
        top_n[b] = item.logprobs
    return RawRows(rows, top_n) if rows else None


def _with_logprobs(results: list[ItemResult], raw: RawRows | None) -> list[ItemResult]:
    """The results with each emitted token's log-probability: an item's token j was drawn at its row j.
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


def _unpack(tokens: torch.Tensor, num_accepted: torch.Tensor) -> list[ItemResult]:
    """One host sync for the whole batch."""
    rows, counts = tokens.tolist(), num_accepted.tolist()
    return [ItemResult(tokens=row[: n + 1], num_accepted=n) for row, n in zip(rows, counts)]
