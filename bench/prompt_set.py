"""The bundled prompt set: bench/prompts/prompts.jsonl, one prompt a line, written for Tandem.

Each line is {"id", "kind", "messages"}. The first 208 prompts interleave three kinds, so that
the first n hold them in equal shares: chat (questions), code (write or edit code) and rewrite
(summarize or rewrite a passage given in the prompt, so the answer copies from it). After them,
8 prompts of each of six kinds shaped like Spec-Bench's categories, so that acceptance per
category can be set beside published tables: multiturn (a follow-up to an earlier exchange),
translation (into English), summarization (news-style articles), qa (short factual questions),
math (word problems, step by step) and rag (answer from the given documents).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

PROMPTS_PATH = Path(__file__).parent / "prompts" / "prompts.jsonl"
KINDS = ("chat", "code", "rewrite", "multiturn", "translation", "summarization", "qa", "math", "rag")


def kinds_with_data(rows: list[dict]) -> list[str]:
    """The kinds (in KINDS order) that any per-kind report row has a figure for."""
    return [k for k in KINDS if any(r[k]["mean_acceptance_length"] is not None for r in rows)]


@dataclass(frozen=True, slots=True)
class Prompt:
    id: str
    kind: str
    messages: tuple[tuple[str, str], ...]  # (role, content)

    def as_dicts(self) -> list[dict[str, str]]:
        return [{"role": role, "content": content} for role, content in self.messages]


def load_prompts(limit: int | None = None, path: Path = PROMPTS_PATH) -> list[Prompt]:
    prompts = []
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            if row["kind"] not in KINDS:
                raise ValueError(f"{path}: prompt {row['id']} has unknown kind {row['kind']!r}")
            messages = tuple((m["role"], m["content"]) for m in row["messages"])
            prompts.append(Prompt(row["id"], row["kind"], messages))
    return prompts[:limit] if limit else prompts
