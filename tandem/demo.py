"""`make demo`: the drafter and the target on loopback with the embedded model, one streamed chat.

Each service gets one core (--threads 1), as DESIGN.md section 7 asks on a small box.
"""
from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

from tandem.cli import run_generate
from tandem.launch import ServiceProcess

PROMPT = "Write a short paragraph about why the ocean looks blue, then list three ocean animals."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--drafter", choices=["model", "ngram"], default="model")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="tandem-demo-"))
    draft = ServiceProcess("draft_service", ["--drafter", args.drafter, "--model", args.model, "--threads", "1"],
                           log_path=logs / "draft.log")
    target = ServiceProcess("target_service", ["--model", args.model, "--threads", "1", "--drafter", draft.address],
                            log_path=logs / "target.log")
    print(f"starting the draft service ({args.drafter}) and the target service; logs in {logs}")
    try:
        draft.start()
        target.start()
        draft.wait_healthy()
        target.wait_healthy()
        print(f"target on {target.address} (metrics {target.metrics_url}), drafter on {draft.address}\n")
        print(f"> {PROMPT}\n")
        cli_args = argparse.Namespace(
            target=target.address, prompt=PROMPT, chat=True, system="", temperature=0.0, top_p=1.0, top_k=0,
            min_p=0.0, seed=None, max_tokens=args.max_tokens, stop=[], no_speculate=False,
            num_speculative_tokens=None,
        )
        asyncio.run(run_generate(cli_args))
    finally:
        codes = (target.terminate(), draft.terminate())
        print(f"stopped both services (exit codes {codes[0]}, {codes[1]})")


if __name__ == "__main__":
    main()
