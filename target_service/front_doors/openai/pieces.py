"""A sequence's outputs as the text and logprobs that OpenAI's bodies and chunks carry."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tandem_kernels.logprobs import TokenLogprob
from target_service.front_doors.openai.bodies import Logprobs, joined
from target_service.sequence import Output, Sequence

Piece = tuple[str, dict[str, Any] | None]  # an output's text, and its tokens' logprobs in OpenAI's shape


@dataclass(slots=True)
class Echo:
    """echo on text completions, as vLLM serves it: each sample's text starts with the prompt's, and its
    logprobs with the prompt tokens' (the first one null)."""

    text: str  # the prompt as sent, or its token ids decoded
    prompt_ids: list[int]
    generate: bool  # false for max_tokens 0: the prompt alone, without the one token the engine sampled
    prompt_logprobs: list[TokenLogprob] | None = None  # prompt tokens 1.., once an output brought them


LogprobsOf = Callable[[Logprobs, list[TokenLogprob]], dict[str, Any]]  # Logprobs.chat or Logprobs.text


def pieces(logprobs_of: LogprobsOf, seq: Sequence, token_text: Callable[[int], str],
           echo: Echo | None = None) -> Callable[[Output], Piece]:
    """One sample's outputs as text and logprobs (in logprobs_of's shape), the prompt's first when echoed."""
    state = Logprobs(token_text) if seq.options.logprobs is not None else None
    echoed = echo is None

    def piece(output: Output) -> Piece:
        nonlocal echoed
        texts, logprobs = [], []
        if echo is not None and output.prompt_logprobs is not None:
            echo.prompt_logprobs = output.prompt_logprobs  # they come with one sample's first output
        if not echoed and (output.token_ids or output.finish is not None):
            echoed = True
            texts.append(echo.text)
            if state is not None:
                if echo.prompt_logprobs is None:
                    raise RuntimeError("echo: the prompt's logprobs did not come with the first output")
                logprobs.append(state.prompt(echo.prompt_ids, echo.prompt_logprobs))
        if echo is None or echo.generate:
            texts.append(output.text)
            if state is not None and output.logprobs:
                logprobs.append(logprobs_of(state, output.logprobs))
        return "".join(texts), joined(logprobs)

    return piece
