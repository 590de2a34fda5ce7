"""JSON schemas with their objects closed, as vLLM's default backend (xgrammar, strict mode) reads them.

A schema's object that lists `properties` and says nothing of other keys allows any other key under
JSON Schema's rules. xgrammar, which vLLM uses by default, compiles schemas in strict mode, where such
an object allows only the keys it lists; a client that wrote its schema against vLLM expects that, and
a small model given an open object may add keys until max_tokens cuts it (a tool call sent by the
Shepherd Model Gateway does). So an object that lists `properties` and sets none of
`additionalProperties`, `unevaluatedProperties` or `patternProperties` is closed here. Unlike strict
mode, an object without `properties` stays open (a schema of `{"type": "object"}` is any object), and
the branches of an `allOf` stay open, since closing each would refuse the keys the others add.
"""
from __future__ import annotations

from typing import Any

_OPENERS = ("additionalProperties", "unevaluatedProperties", "patternProperties")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SCHEMAS = ("items", "additionalItems", "unevaluatedItems", "additionalProperties", "unevaluatedProperties",
            "propertyNames", "contains", "not", "if", "then", "else")


def closed_objects(schema: Any, close: bool = True) -> Any:
    """`schema` with each object that lists properties, and allows no other key by name, closed to others."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(sub) for name, sub in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(sub) for sub in out[key]]
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [closed_objects(sub, close=False) for sub in out["allOf"]]
    for key in _SCHEMAS:
        value = out.get(key)
        if isinstance(value, list):  # items as a list: draft 7's tuple
            out[key] = [closed_objects(sub) for sub in value]
        elif isinstance(value, dict):
            out[key] = closed_objects(value)
    if close and isinstance(out.get("properties"), dict) and not any(key in out for key in _OPENERS):
        out["additionalProperties"] = False
    return out
