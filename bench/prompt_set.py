"""The bundled prompt set: bench/prompts/prompts.jsonl, one prompt a line, written for Tandem.

Each line is {"id", "kind", "messages"}; kind is chat (questions), code (write or edit code) or
rewrite (summarize or rewrite a passage given in the prompt, so the answer copies from it).
The file interleaves the kinds, so the first n prompts hold all three in equal shares.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

PROMPTS_PATH = Path(__file__).parent / "prompts" / "prompts.jsonl"
KINDS = ("chat", "code", "rewrite")


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
