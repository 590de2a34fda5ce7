"""Mean acceptance length of each drafter kind, per prompt kind, along the target's own greedy outputs.

    python -m bench.drafter_mal [--per-kind 16] [--max-tokens 128] [--k 4] [--confidences 0.5,0.75,1]

The target's greedy continuation of each bench prompt is generated once (cached in --cache). Then,
for each drafter kind, a draft service starts (one thread), and this script plays a synchronous
target on its Speculate stream: one sequence at a time, it sends the committed tokens, takes the
proposal for them, commits the drafts that equal the target's continuation plus one more token,
and sends that Extend. The mean acceptance length (MAL) is the tokens committed per verify step,
what a greedy pair with --sync-speculation measures, without the timing noise. Prompts run in the
bench's order on one stream, so the suffix drafter's shared cache holds the earlier outputs.

--eagle-head FOLDER adds an `eagle3` row: the script then also plays the target's part in sending
features (the layers the head's Info names, computed by one capturing forward of the target over
prompt and output) with each Extend. Such a head drafts nothing before the first Extend brings the
prompt's features, so its first step commits one token without drafts, as other rows' steps may not.
--drafters picks rows by name.

The last row, `copy-oracle`, is no drafter but a bound on all that copy: computed in this process,
it drafts at each step the continuation of whichever earlier occurrence of the last token (in the
request or in an earlier case's output) matches the target's next tokens longest.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc
import numpy as np
import torch

from bench.prompt_set import KINDS, load_prompts
from bench.serve import EAGLE3, eagle3_drafter_flags
from tandem.hidden_states import FeatureLayout
from tandem.model.batch import SequenceChunk
from bench.greedy import greedy_generate
from tandem.launch import ServiceProcess
from tandem.registry import DEFAULT_DRAFT_MODEL, DEFAULT_MODEL
from tandem.runtime import load_model
from tandem.v1 import drafter_pb2 as pb
from tandem.v1 import drafter_pb2_grpc
from tandem.v1.structured_pb2 import StructuredOutputs

COPY_ORACLE = "copy-oracle"  # the row of copy_oracle: a bound on lookup drafters, not a drafter


@dataclass(frozen=True, slots=True)
class Case:
    kind: str
    prompt: list[int]
    output: list[int]  # the target's greedy continuation


def target_outputs(per_kind: int, max_tokens: int, model: str, cache: Path) -> list[Case]:
    """Each kind's first `per_kind` prompts, interleaved as the bench file has them, with the target's outputs."""
    taken: dict[str, int] = defaultdict(int)
    chosen = []
    for prompt in load_prompts():
        if taken[prompt.kind] < per_kind:
            taken[prompt.kind] += 1
            chosen.append(prompt)
    key = json.dumps([model, max_tokens, [p.as_dicts() for p in chosen]])  # a changed prompt file regenerates
    if cache.exists() and (saved := json.loads(cache.read_text())).get("key") == key:
        return [Case(**case) for case in saved["cases"]]
    loaded = load_model(model, num_slots=1)
    cases = []
    for prompt in chosen:
        ids = loaded.tokenizer.encode_chat(prompt.as_dicts())
        output = greedy_generate(loaded.model, ids, max_tokens, stop_token_ids=loaded.tokenizer.eos_token_ids)
        cases.append(Case(prompt.kind, ids, output))
    cache.write_text(json.dumps({"key": key, "cases": [asdict(case) for case in cases]}))
    return cases


async def proposal_for(call: grpc.aio.StreamStreamCall, seq_id: int, base_len: int) -> list[int]:
    """The drafts of the drafter's proposal for the sequence's first base_len tokens."""
    while True:
        message = await asyncio.wait_for(call.read(), 120)
        if message is grpc.aio.EOF:
            raise RuntimeError("the drafter ended the stream")
        for proposal in message.proposals:
            if proposal.seq_id == seq_id and proposal.base_len == base_len and not proposal.assumed_ids:
                return list(proposal.token_ids)


@dataclass(frozen=True, slots=True)
class CaseFeatures:
    """The target's features along one case, for a drafter that reads them."""

    layout: FeatureLayout
    rows: torch.Tensor  # [len(prompt) + len(output) - 1, layers, hidden]: row p the feature of position p


def case_features(cases: list[Case], model: str, layout: FeatureLayout) -> list[CaseFeatures]:
    """One capturing forward of the target over each case's prompt and output."""
    loaded = load_model(model, num_slots=1, max_model_len=max(len(c.prompt) + len(c.output) for c in cases))
    features = []
    for case in cases:
        tokens = (case.prompt + case.output)[:-1]
        batch = loaded.model.build_batch([SequenceChunk(0, 0, tokens)])
        features.append(CaseFeatures(layout, loaded.model.forward_capturing(batch, layout.layers)[1]))
    return features


async def replay(call: grpc.aio.StreamStreamCall, case: Case, seq_id: int, k: int,
                 constraint: StructuredOutputs | None = None,
                 features: CaseFeatures | None = None) -> tuple[int, int]:
    """Synchronous greedy speculation along the case's output: (verify steps, tokens committed).

    constraint: the output's structured-output constraint, sent to the drafter with the Open.
    features: sent with each Extend, the rows of the positions read since the last one."""
    opened = pb.SequenceOpen(seq_id=seq_id, prompt_ids=case.prompt, k=k)
    if constraint is not None:
        opened.structured_outputs.CopyFrom(constraint)
        opened.constrained_from = len(case.prompt)
    await call.write(pb.TargetUpdate(opens=[opened]))
    steps = committed = 0
    while committed < len(case.output):
        drafts = await proposal_for(call, seq_id, len(case.prompt) + committed)
        truth = case.output[committed : committed + len(drafts)]
        accepted = next((i for i, (d, t) in enumerate(zip(drafts, truth)) if d != t), len(truth))
        new = case.output[committed : committed + accepted + 1]
        steps += 1
        if committed + len(new) < len(case.output):
            start = len(case.prompt) + committed
            extend = pb.SequenceExtend(seq_id=seq_id, start=start, token_ids=new)
            if features is not None:
                extend.hidden_start = start - 1 if committed else 0
                extend.hidden_states = features.layout.encode(
                    features.rows[extend.hidden_start : start + len(new) - 1])
            await call.write(pb.TargetUpdate(extends=[extend]))
        committed += len(new)
    await call.write(pb.TargetUpdate(closes=[pb.SequenceClose(seq_id=seq_id)]))
    return steps, committed


async def measure(address: str, cases: list[Case], k: int,
                  constraints: list[StructuredOutputs] | None = None,
                  features: list[CaseFeatures] | None = None) -> dict[str, float]:
    """MAL per prompt kind and over all, the cases one after another on one stream (each under its
    constraint, and with its target features, when given)."""
    steps: dict[str, int] = defaultdict(int)
    tokens: dict[str, int] = defaultdict(int)
    async with grpc.aio.insecure_channel(address) as channel:
        call = drafter_pb2_grpc.DrafterStub(channel).Speculate()
        for seq_id, case in enumerate(cases):
            s, t = await replay(call, case, seq_id, k, None if constraints is None else constraints[seq_id],
                                None if features is None else features[seq_id])
            steps[case.kind] += s
            tokens[case.kind] += t
        call.cancel()
    return mal_by_kind(steps, tokens)


def mal_by_kind(steps: dict[str, int], tokens: dict[str, int]) -> dict[str, float]:
    """Tokens committed per verify step, per prompt kind and over all."""
    result = {kind: tokens[kind] / steps[kind] for kind in KINDS if steps[kind]}
    result["all"] = sum(tokens.values()) / max(1, sum(steps.values()))
    return result


def copy_oracle(cases: list[Case], k: int) -> dict[str, float]:
    """The MAL that no drafter copying earlier text can beat, replayed like `measure` in this process.

    At each step it drafts, of all the earlier occurrences of the last committed token (in the
    request's prompt and output so far, and in the earlier cases' outputs, which a suffix cache
    holds), the continuation that agrees longest with the target's own next k tokens."""
    steps: dict[str, int] = defaultdict(int)
    tokens: dict[str, int] = defaultdict(int)
    earlier: list[np.ndarray] = []
    for case in cases:
        committed = 0
        while committed < len(case.output):
            context = np.asarray(case.prompt + case.output[:committed])
            truth = case.output[committed : committed + k]
            accepted = max(_longest_copy(doc, context[-1], truth) for doc in (context[:-1], *earlier))
            committed += min(accepted + 1, len(case.output) - committed)
            steps[case.kind] += 1
        tokens[case.kind] += len(case.output)
        earlier.append(np.asarray(case.output))
    return mal_by_kind(steps, tokens)


def _longest_copy(doc: np.ndarray, last: int, truth: list[int]) -> int:
    """How many of truth's tokens the best continuation of an occurrence of `last` in doc matches."""
    best = 0
    for follow in np.flatnonzero(doc[:-1] == last) + 1:
        copied = doc[follow : follow + len(truth)].tolist()
        matched = next((i for i, (c, t) in enumerate(zip(copied, truth)) if c != t), min(len(copied), len(truth)))
        best = max(best, matched)
    return best


def variants(confidences: list[float], args: argparse.Namespace) -> dict[str, list[str]]:
    """Draft-service flags by row name."""
    rows = {"ngram": ["--drafter", "ngram"], "suffix": ["--drafter", "suffix"], "model": ["--drafter", "model"]}
    for share in confidences:
        rows[f"suffix+model@{share:g}"] = ["--drafter", "suffix+model", "--suffix-confidence", str(share)]
    if args.eagle_head:
        rows[EAGLE3] = eagle3_drafter_flags(args.eagle_head, args.model)
    return rows


def run_variant(flags: list[str], cases: list[Case], args: argparse.Namespace, log: Path) -> dict[str, float]:
    longest = max(len(c.prompt) + len(c.output) for c in cases) + args.k + 2
    draft = ServiceProcess("draft_service", ["--model", args.draft_model, "--threads", "1", "--max-k", str(args.k),
                                             "--max-model-len", str(longest), *flags], log_path=log)
    try:
        draft.start().wait_healthy(timeout=300)
        with draft.channel() as channel:
            info = drafter_pb2_grpc.DrafterStub(channel).Info(pb.DrafterInfoRequest(), timeout=30)
        features = None
        if info.hidden_layers:
            layout = FeatureLayout(tuple(info.hidden_layers), info.target_hidden_size)
            features = case_features(cases, args.model, layout)
        return asyncio.run(measure(draft.address, cases, args.k, features=features))
    finally:
        draft.kill()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--per-kind", type=int, default=16, help="prompts of each kind")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--draft-model", default=DEFAULT_DRAFT_MODEL)
    parser.add_argument("--confidences", default="0.5,0.75,1", help="suffix+model thresholds to try (share of k)")
    parser.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "tandem-drafter-mal.json")
    parser.add_argument("--eagle-head", default="", help="an EAGLE-3 head folder for --model: adds an eagle3 row")
    parser.add_argument("--drafters", default="", help="comma-separated rows to run (default: all)")
    args = parser.parse_args(argv)
    cases = target_outputs(args.per_kind, args.max_tokens, args.model, args.cache)
    log_dir = Path(tempfile.mkdtemp())
    print(f"{len(cases)} prompts, {sum(len(c.output) for c in cases)} target tokens, k={args.k}, greedy "
          f"(logs: {log_dir})")
    print(f"| drafter | {' | '.join(KINDS)} | all |")
    print(f"|---|{'---|' * len(KINDS)}---|")
    wanted = set(args.drafters.split(",")) if args.drafters else None
    for name, flags in variants([float(s) for s in args.confidences.split(",") if s], args).items():
        if wanted is not None and name not in wanted:
            continue
        print_row(name, run_variant(flags, cases, args, log_dir / f"{name}.log"))
    if wanted is None or COPY_ORACLE in wanted:
        print_row(COPY_ORACLE, copy_oracle(cases, args.k))


def print_row(name: str, mal: dict[str, float]) -> None:
    print(f"| {name} | {' | '.join(f'{mal.get(kind, 0):.2f}' for kind in (*KINDS, 'all'))} |", flush=True)


if __name__ == "__main__":
    main()
