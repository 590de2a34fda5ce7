"""A request's output constraint as the wire carries it (structured.proto), checked for size."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from tandem.v1 import structured_pb2

MAX_SPEC_CHARS = 65_536  # a schema, regex or grammar, or all choices together
MAX_CHOICES = 1_024
KINDS = ("json", "json_object", "regex", "grammar", "choice")


class ConstraintError(ValueError):
    """A constraint that cannot be used; `field` names the request field to fix."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


@dataclass(frozen=True, slots=True)
class Constraint:
    kind: str  # one of KINDS
    spec: str | tuple[str, ...]  # the schema text, regex or grammar; the choices; "" for json_object
    compact: bool = False  # JSON kinds: no whitespace between tokens (disable_any_whitespace)

    @property
    def field(self) -> str:
        return f"structured_outputs.{self.kind}"

    @property
    def key(self) -> str:
        """The content hash that compiled grammars are cached by."""
        return hashlib.sha256(json.dumps([self.kind, self.spec, self.compact]).encode()).hexdigest()

    @classmethod
    def from_proto(cls, msg: structured_pb2.StructuredOutputs) -> Constraint | None:
        """The constraint a request sets, None when it sets none; ConstraintError past the size limits."""
        kind = msg.WhichOneof("constraint")
        if kind is None:
            if msg.disable_any_whitespace:
                raise ConstraintError("structured_outputs", "disable_any_whitespace needs json or json_object set")
            return None
        if msg.disable_any_whitespace and kind not in ("json", "json_object"):
            raise ConstraintError("structured_outputs.disable_any_whitespace", f"applies to json and json_object, "
                                                                             f"not to {kind}")
        if kind == "json_object":
            if not msg.json_object:
                raise ConstraintError("structured_outputs.json_object", "set it to true, or leave structured_outputs unset")
            return cls(kind, "", msg.disable_any_whitespace)
        if kind == "choice":
            return cls(kind, _checked_choices(list(msg.choice.choices)))
        spec = getattr(msg, kind)
        if not spec.strip():
            raise ConstraintError(f"structured_outputs.{kind}", "must not be empty")
        if len(spec) > MAX_SPEC_CHARS:
            raise ConstraintError(f"structured_outputs.{kind}", f"has {len(spec)} characters, at most {MAX_SPEC_CHARS}")
        return cls(kind, spec, msg.disable_any_whitespace)

    def to_proto(self) -> structured_pb2.StructuredOutputs:
        if self.kind == "json_object":
            return structured_pb2.StructuredOutputs(json_object=True, disable_any_whitespace=self.compact)
        if self.kind == "choice":
            return structured_pb2.StructuredOutputs(choice=structured_pb2.Choices(choices=self.spec))
        return structured_pb2.StructuredOutputs(**{self.kind: self.spec}, disable_any_whitespace=self.compact)


def _checked_choices(choices: list[str]) -> tuple[str, ...]:
    field = "structured_outputs.choice.choices"
    if not choices:
        raise ConstraintError(field, "must hold at least one string")
    if len(choices) > MAX_CHOICES:
        raise ConstraintError(field, f"has {len(choices)} strings, at most {MAX_CHOICES}")
    if any(not c for c in choices):
        raise ConstraintError(field, f"choice {choices.index('')} is empty")
    if sum(map(len, choices)) > MAX_SPEC_CHARS:
        raise ConstraintError(field, f"hold more than {MAX_SPEC_CHARS} characters in all")
    return tuple(choices)
