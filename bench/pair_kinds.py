"""Which drafter pays on a mix of prompts: each drafter against the target alone, per prompt kind.

    python -m bench.pair_kinds [--drafters ngram,suffix,suffix+model,model] [--kinds chat,code,rewrite]
                               [--num-prompts 6] [--concurrency 1,8] [--max-tokens 128]
                               [--eagle-head HEAD]   (adds the drafter eagle3: that EAGLE-3 head)

bench.network on loopback: the target alone and a pair per drafter (one thread each, as deployed),
all up at once, each prompt sent to every configuration in turn, greedy. After its table it prints,
per drafter and concurrency, the mix: the geometric mean over the kinds of tokens/s ÷ alone, and the
worst kind. The draft service's default drafter is the one with the best mix (docs/drafters.md).
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path

from bench import network
from bench.serve import EAGLE3


def mix(rows: list[dict]) -> list[dict]:
    """Per (drafter, concurrency): the geometric mean of tokens/s ÷ alone over the kinds, and the worst kind."""
    mixes = []
    for config, concurrency in dict.fromkeys((r["config"], r["concurrency"]) for r in rows if r["config"] != network.ALONE):
        mine = [r for r in rows if (r["config"], r["concurrency"]) == (config, concurrency)]
        worst = min(mine, key=lambda r: r["vs_alone"])
        mixes.append({"config": config, "concurrency": concurrency,
                      "mix": math.exp(sum(math.log(r["vs_alone"]) for r in mine) / len(mine)),
                      "worst": worst["vs_alone"], "worst_kind": worst["kind"],
                      "identical": sum(r["identical"] for r in mine), "prompts": sum(r["prompts"] for r in mine)})
    return mixes


def mix_table(mixes: list[dict]) -> str:
    lines = ["| drafter | c | mix: tokens/s ÷ alone (geometric mean) | worst kind | identical |", "|---|---|---|---|---|"]
    lines += [f"| {m['config']} | {m['concurrency']} | {m['mix']:.3f} | {m['worst']:.2f} ({m['worst_kind']}) | "
              f"{m['identical']}/{m['prompts']} |" for m in mixes]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafters", default="ngram,suffix,suffix+model,model")
    parser.add_argument("--kinds", default="chat,code,rewrite")
    parser.add_argument("--num-prompts", default="6", help="per kind")
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--max-tokens", default="128")
    parser.add_argument("--eagle-head", help="an EAGLE-3 head folder for the drafter eagle3 (distill --kind eagle3)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "pair_kinds")
    args = parser.parse_args(argv)
    drafters = args.drafters.split(",")
    if args.eagle_head and EAGLE3 not in drafters:
        drafters.append(EAGLE3)
    rows = network.main(["--rtts", network.LOOPBACK, "--drafters", ",".join(drafters), "--kinds", args.kinds,
                         "--num-prompts", args.num_prompts, "--concurrency", args.concurrency,
                         "--max-tokens", args.max_tokens, "--out", str(args.out),
                         *(["--eagle-head", args.eagle_head] if args.eagle_head else [])])
    mixes = mix(rows)
    table = mix_table(mixes)
    with args.out.with_suffix(".md").open("a") as out:
        out.write("\n" + table + "\n")
    print(table)
    return mixes


if __name__ == "__main__":
    main()
