"""The bundled prompt set: bench/prompts/prompts.jsonl, one prompt a line, written for Tandem.

Each line is {"id", "kind", "messages"}. The first 208 prompts interleave three kinds, so that
the first n hold them in equal shares: chat (questions), code (write or edit code) and rewrite
(summarize or rewrite a passage given in the prompt, so the answer copies from it). After them,
8 prompts of each of six kinds shaped like Spec-Bench's categories, so that acceptance per
category can be set beside published tables: multiturn (a follow-up to an earlier exchange),
translation (into English), summarization (news-style articles), qa (short factual questions),
math (word problems, step by step) and rag (answer from the given documents).

bench/prompts/json_extraction.jsonl holds the structured-output set: {"id", "kind": "json", "schema",
"messages", "reference"}, each a passage to extract into its JSON schema (nested objects, enums,
arrays, numbers, strings with patterns), and a correct answer written by hand.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

PROMPTS_PATH = Path(__file__).parent / "prompts" / "prompts.jsonl"
JSON_PROMPTS_PATH = Path(__file__).parent / "prompts" / "json_extraction.jsonl"
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


@dataclass(frozen=True, slots=True)
class JsonPrompt(Prompt):
    schema: dict
    reference: dict  # a correct answer, which follows the schema


def _rows(path: Path, limit: int | None) -> list[tuple[dict, tuple[tuple[str, str], ...]]]:
    """Each line's fields and its messages as (role, content) pairs."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [(row, tuple((m["role"], m["content"]) for m in row["messages"])) for row in rows[:limit or None]]


def load_prompts(limit: int | None = None, path: Path = PROMPTS_PATH) -> list[Prompt]:
    prompts = []
    for row, messages in _rows(path, limit):
        if row["kind"] not in KINDS:
            raise ValueError(f"{path}: prompt {row['id']} has unknown kind {row['kind']!r}")
        prompts.append(Prompt(row["id"], row["kind"], messages))
    return prompts


def load_json_prompts(limit: int | None = None, path: Path = JSON_PROMPTS_PATH) -> list[JsonPrompt]:
    """The JSON-extraction prompts, each with the schema its answer must follow."""
    return [JsonPrompt(row["id"], row["kind"], messages, row["schema"], row["reference"])
            for row, messages in _rows(path, limit)]
