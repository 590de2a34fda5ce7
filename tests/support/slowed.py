"""A service slowed down for a test: `python -m tests.support.slowed --service S --FLAG MS args`.

  --service target_service --min-step-ms MS   each forward of a step (prompts, or the running
                                              sequences' decode or verify) lasts at least MS: a
                                              tiny model made to step like a larger one, so that
                                              a drafter of its size is ahead of it
  --service draft_service --delay-ms MS       each drafting round that drafted something ends MS
                                              later: a slow drafter

The services themselves carry no such hook: the slowdown wraps their step here, in the test's process.
"""
from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Callable


def _at_least(seconds: float, run: Callable) -> Callable:
    """run, made to last at least `seconds` (on the thread it runs on, as a larger model's step would)."""

    @functools.wraps(run)
    def slowed(*args, **kwargs):
        started = time.perf_counter()
        result = run(*args, **kwargs)
        time.sleep(max(0.0, seconds - (time.perf_counter() - started)))
        return result

    return slowed


def _then_wait(seconds: float, run: Callable) -> Callable:
    """run, then a wait of `seconds` when it returned drafts."""

    @functools.wraps(run)
    def slowed(*args, **kwargs):
        result = run(*args, **kwargs)
        if result:
            time.sleep(seconds)
        return result

    return slowed


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="slowed")
    parser.add_argument("--service", choices=["target_service", "draft_service"], required=True)
    parser.add_argument("--min-step-ms", type=float, default=0.0)
    parser.add_argument("--delay-ms", type=float, default=0.0)
    flags, rest = parser.parse_known_args(argv)
    if flags.service == "target_service":
        from target_service.__main__ import main as serve
        from target_service.model_runner import ModelRunner

        ModelRunner.run = _at_least(flags.min_step_ms / 1000, ModelRunner.run)
    else:
        from draft_service.__main__ import main as serve
        from draft_service.scheduler import DraftScheduler

        DraftScheduler._round = _then_wait(flags.delay_ms / 1000, DraftScheduler._round)
    raise SystemExit(serve(rest))


if __name__ == "__main__":
    main(sys.argv[1:])
