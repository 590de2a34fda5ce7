"""The drafter's busy time per target step with pre-drafting: a fresh round, then a pre-draft round.

    python bench/predraft_rounds.py [--sequences 1 4] [--steps 15] [--context 256] [--k 4]

Starts a draft service (the distilled drafter by default, on one thread) and plays a target that
keeps pre-drafts on its Speculate stream: it opens the sequences, then at each step commits an
outcome that no pre-draft covers (d1, then a token no pre-draft assumed). So every step costs the
drafter a fresh round (1 row per sequence) and then a pre-draft round of the k + 1 outcomes of the
new proposal (k + 1 rows per sequence, one forward more for the bonus guess). Prints the medians
of each round's `draft_time_ns`, as the drafter reports it: what the target's step time must
leave room for. A hit costs only the pre-draft round.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import grpc

from tandem.launch import ServiceProcess
from tandem.registry import DEFAULT_DRAFT_MODEL
from tandem.v1 import drafter_pb2 as pb
from tandem.v1 import drafter_pb2_grpc

FIRST_ID = 2000  # prompt ids: any ids inside the vocabulary time the same


async def next_proposals(call: grpc.aio.StreamStreamCall) -> tuple[list[pb.DraftProposal], float]:
    """The next message's proposals and its round time in ms."""
    message = await asyncio.wait_for(call.read(), 120)
    if message is grpc.aio.EOF:
        raise RuntimeError("the drafter ended the stream")
    return list(message.proposals), message.draft_time_ns / 1e6


def uncovered_step(fresh: pb.DraftProposal, predrafts: list[pb.DraftProposal]) -> list[int]:
    """d1, then a token that neither d2 nor any pre-draft's second assumed token is."""
    taken = {fresh.token_ids[1]} | {p.assumed_ids[1] for p in predrafts if len(p.assumed_ids) >= 2}
    return [fresh.token_ids[0], min(set(range(FIRST_ID)) - taken)]


async def measure(address: str, sequences: int, steps: int, context: int, k: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {"fresh": [], "pre-draft": []}
    async with grpc.aio.insecure_channel(address) as channel:
        call = drafter_pb2_grpc.DrafterStub(channel).Speculate()
        tokens = {i: [FIRST_ID + 97 * i + t for t in range(context)] for i in range(sequences)}
        await call.write(pb.TargetUpdate(opens=[pb.SequenceOpen(seq_id=i, prompt_ids=p, k=k, accepts_assumed=True)
                                                for i, p in tokens.items()]))
        for step in range(steps + 1):
            fresh, fresh_ms = await next_proposals(call)
            predrafts, predraft_ms = await next_proposals(call)
            if any(p.assumed_ids for p in fresh) or not all(p.assumed_ids for p in predrafts):
                raise RuntimeError("expected a fresh round, then a pre-draft round")
            if step:  # the first fresh round prefills the prompts
                times["fresh"].append(fresh_ms)
                times["pre-draft"].append(predraft_ms)
            extends = []
            for proposal in fresh:
                committed = uncovered_step(proposal, [p for p in predrafts if p.seq_id == proposal.seq_id])
                extends.append(pb.SequenceExtend(seq_id=proposal.seq_id, start=len(tokens[proposal.seq_id]),
                                                 token_ids=committed))
                tokens[proposal.seq_id] += committed
            await call.write(pb.TargetUpdate(extends=extends))
        call.cancel()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_DRAFT_MODEL)
    parser.add_argument("--sequences", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    slots = max(args.sequences) * (args.k + 2)  # each sequence's own slot and one per outcome
    log = Path(tempfile.mkdtemp()) / "draft.log"
    draft = ServiceProcess("draft_service", ["--drafter", "model", "--model", args.model, "--threads", str(args.threads),
                                             "--num-slots", str(slots), "--max-k", str(args.k), "--max-model-len",
                                             str(args.context + 2 * args.steps + 2 * args.k + 8)], log_path=log)
    try:
        draft.start().wait_healthy(timeout=300)
        print(f"{args.model}, k={args.k}, context {args.context}, {args.threads} thread(s); medians over "
              f"{args.steps} steps (log: {log})")
        print("| sequences | fresh round (rows) | pre-draft round (rows) |\n| --- | --- | --- |")
        for sequences in args.sequences:
            times = asyncio.run(measure(draft.address, sequences, args.steps, args.context, args.k))
            fresh, predraft = statistics.median(times["fresh"]), statistics.median(times["pre-draft"])
            print(f"| {sequences} | {fresh:.1f} ms ({sequences}) | {predraft:.1f} ms ({sequences * (args.k + 1)}) |")
    finally:
        draft.kill()


if __name__ == "__main__":
    main()
