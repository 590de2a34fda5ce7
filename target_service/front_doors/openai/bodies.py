"""OpenAI response bodies (vLLM's shapes) from a finished or streaming sequence."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tandem_kernels.logprobs import TokenLogprob
from target_service.front_doors.openai.tools import answer_of
from target_service.front_doors.tool_calls import ToolChoice
from target_service.sequence import FinishReason, Sequence

LOWEST_LOGPROB = -9999.0  # JSON has no -Infinity; vLLM sends this in its place


@dataclass(frozen=True, slots=True)
class Completion:
    """What every body and chunk of one response repeats."""

    id: str
    object: str  # chat.completion, chat.completion.chunk or text_completion
    created: int
    model: str

    def body(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": choices, **extra}


def usage(samples: list[Sequence]) -> dict[str, Any]:
    """Each prompt once (and how much of it the prefix cache held), and every sample's tokens; the
    samples of one prompt share a group."""
    firsts = {seq.group: seq for seq in reversed(samples)}.values()
    prompt, completion = sum(len(seq.prompt_ids) for seq in firsts), sum(seq.num_generated for seq in samples)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(seq.cached_tokens for seq in firsts)}}


def speculation_metrics(samples: list[Sequence]) -> dict[str, Any] | None:
    """vLLM's per-request `metrics.speculative_decoding` (what aiperf reads), over every sample; None
    when the request did not speculate.

    acceptance_histogram[a] counts the draft steps that committed a drafts: it has k + 1 entries and
    sums to num_spec_steps."""
    options = samples[0].options
    k = options.num_speculative_tokens
    if not options.speculate or k == 0:
        return None
    histogram = [0] * (k + 1)
    for seq in samples:
        for accepted, steps in enumerate(seq.acceptance_histogram):
            histogram[accepted] += steps
    steps = sum(seq.draft_steps for seq in samples)
    drafts = sum(seq.draft_tokens for seq in samples)
    accepted = sum(seq.accepted_tokens for seq in samples)
    return {"speculative_decoding": {
        "num_spec_tokens": k,
        "num_spec_steps": steps,
        "num_draft_tokens": drafts,
        "num_accepted_draft_tokens": accepted,
        "draft_acceptance_rate": accepted / drafts if drafts else 0.0,
        "mean_acceptance_length": 1 + accepted / steps if steps else 1.0,
        "acceptance_histogram": histogram,
    }}


def finish_reason(seq: Sequence) -> str:
    return (seq.finish or FinishReason.ABORT).value


@dataclass(slots=True)
class Logprobs:
    """OpenAI's logprobs objects for one request's tokens: chat's `content` list, or the four lists of
    text completions, whose `text_offset` runs on from one chunk to the next."""

    token_text: Callable[[int], str]
    offset: int = 0  # text completions: where the next token's text starts in the completion

    def chat(self, logprobs: list[TokenLogprob]) -> dict[str, Any]:
        return {"content": [{**self._entry(lp.token, lp.logprob),
                             "top_logprobs": [self._entry(token, value) for token, value in lp.top]}
                            for lp in logprobs]}

    def text(self, logprobs: list[TokenLogprob]) -> dict[str, Any]:
        """The top alternatives with the sampled token among them, as OpenAI's legacy API returns them."""
        tokens = [self.token_text(lp.token) for lp in logprobs]
        offsets = []
        for token in tokens:
            offsets.append(self.offset)
            self.offset += len(token)
        return {"tokens": tokens, "token_logprobs": [_finite(lp.logprob) for lp in logprobs],
                "top_logprobs": [{self.token_text(t): _finite(v) for t, v in (*lp.top, (lp.token, lp.logprob))}
                                 for lp in logprobs],
                "text_offset": offsets}

    def prompt(self, prompt_ids: list[int], logprobs: list[TokenLogprob]) -> dict[str, Any]:
        """The prompt's tokens as `text` shows a completion's (echo); the first has no logprob: null."""
        first = self.token_text(prompt_ids[0])
        head = {"tokens": [first], "token_logprobs": [None], "top_logprobs": [None], "text_offset": [self.offset]}
        self.offset += len(first)
        return joined([head, self.text(logprobs)])

    def _entry(self, token: int, logprob: float) -> dict[str, Any]:
        text = self.token_text(token)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode())}


def joined(parts: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The logprobs objects of consecutive tokens as one (their lists end to end); None for none."""
    if not parts:
        return None
    return {key: [value for part in parts for value in part[key]] for key in parts[0]}


def prompt_logprobs(token_text: Callable[[int], str], prompt_ids: list[int],
                    logprobs: list[TokenLogprob] | None) -> list[dict[str, Any] | None] | None:
    """vLLM's `prompt_logprobs`: None for the first prompt token, then per token a map from token id
    to its logprob, rank and text, for the prompt's token and the top alternatives; None when not asked."""
    if logprobs is None:
        return None
    entries: list[dict[str, Any] | None] = [None]
    for token, lp in zip(prompt_ids[1:], logprobs, strict=True):
        ranked = [(token, lp.logprob, lp.rank), *((t, v, rank) for rank, (t, v) in enumerate(lp.top, 1))]
        entries.append({str(t): {"logprob": _finite(v), "rank": rank, "decoded_token": token_text(t)}
                        for t, v, rank in ranked})
    return entries


def _finite(logprob: float) -> float:
    return max(logprob, LOWEST_LOGPROB)


Prompt = list[dict[str, Any] | None] | None  # the prompt's logprobs (prompt_logprobs), when asked


def chat_response(meta: Completion, samples: list[Sequence], texts: list[str], logprobs: list[dict[str, Any] | None],
                  prompts: list[Prompt], tool_choice: ToolChoice | None = None) -> dict[str, Any]:
    """A choice per sample; the prompt's logprobs (prompts[i]: sample i's, all one prompt's) go beside the
    choices, as vLLM puts them. The calls an answer made (tool_choice) are the message's tool_calls."""
    choices = []
    for index, (seq, text, lp) in enumerate(zip(samples, texts, logprobs, strict=True)):
        content, calls = answer_of(tool_choice, text) if tool_choice is not None else (text, None)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        reason = finish_reason(seq)
        if calls is not None:
            message["tool_calls"] = calls
            reason = tool_choice.finish_reason if seq.finish is FinishReason.STOP else reason
        choices.append({"index": index, "message": message, "logprobs": lp, "finish_reason": reason,
                        "stop_reason": seq.stop_reason})
    return meta.body(choices, usage=usage(samples), metrics=speculation_metrics(samples),
                     prompt_logprobs=prompts[0])


def text_response(meta: Completion, samples: list[Sequence], texts: list[str], logprobs: list[dict[str, Any] | None],
                  prompts: list[Prompt]) -> dict[str, Any]:
    """A choice per sample, each with its prompt's logprobs, as vLLM puts them."""
    choices = [{"index": index, "text": text, "logprobs": lp, "finish_reason": finish_reason(seq),
                "stop_reason": seq.stop_reason, "prompt_logprobs": prompt}
               for index, (seq, text, lp, prompt) in enumerate(zip(samples, texts, logprobs, prompts, strict=True))]
    return meta.body(choices, usage=usage(samples), metrics=speculation_metrics(samples))


def chat_chunk(meta: Completion, index: int, seq: Sequence, delta: dict[str, Any], finished: bool = False,
               logprobs: dict[str, Any] | None = None, reason: str | None = None) -> dict[str, Any]:
    """A delta of seq's choice (`index`); `finished`: the choice's last chunk, which carries why it
    finished (`reason`, or the sequence's own)."""
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": None}
    if finished:
        choice.update(finish_reason=reason or finish_reason(seq), stop_reason=seq.stop_reason)
    return meta.body([choice])


def text_chunk(meta: Completion, index: int, seq: Sequence, text: str, finished: bool = False,
               logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": None, "stop_reason": None}
    if finished:
        choice.update(finish_reason=finish_reason(seq), stop_reason=seq.stop_reason)
    return meta.body([choice])


def usage_chunk(meta: Completion, samples: list[Sequence]) -> dict[str, Any]:
    """The stream's last chunk when the client asked for usage: no choices."""
    extra: dict[str, Any] = {"usage": usage(samples)}
    metrics = speculation_metrics(samples)
    if metrics is not None:
        extra["metrics"] = metrics
    return meta.body([], **extra)


def error_body(message: str, error_type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}
