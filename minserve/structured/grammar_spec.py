"""A structured-output request as the one text the grammar library compiles: its cache key.

Every kind of constraint becomes one of three grammars xgrammar compiles: a JSON schema, a
regular expression, or an EBNF grammar (a `choice` is written as one: `root ::= "a" | "b"`).
Requests with the same constraint share one compiled grammar (`compiler.py` caches by this
spec), so a schema given as text or as a dict, with any spacing, is written out the same way
(its keys keep their order: a schema's property order is the order the output follows).

xgrammar ignores a few JSON-schema keywords with a warning in its log; a constraint the
engine would not enforce is refused here instead, naming the keyword.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from minserve.errors import StructuredOutputError
from minserve.sampling_params import StructuredOutputsParams

# Keywords xgrammar's JSON-schema converter does not enforce (it logs a warning and goes on).
UNENFORCED_KEYWORDS = frozenset({
    "multipleOf", "uniqueItems", "contains", "minContains", "maxContains", "not", "if",
    "then", "else", "dependentRequired", "dependentSchemas", "dependencies",
})  # fmt: skip
# Where a schema holds other schemas: by name, one, or a list of them.
_NAMED_SUBSCHEMAS = ("properties", "patternProperties", "$defs", "definitions")
_ONE_SUBSCHEMA = (
    "items", "additionalItems", "additionalProperties", "propertyNames",
    "unevaluatedItems", "unevaluatedProperties",
)  # fmt: skip
_SUBSCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf")
JSON_OBJECT_SCHEMA = '{"type":"object"}'
# Whitespace characters allowed between two JSON tokens: pretty-printing to 7 levels with a
# 2-space indent, and a bound: unbounded, a small model sampled at temperature 0.8 can write
# newlines until max_tokens (SmolLM2 did, for one schema in fifteen).
JSON_MAX_WHITESPACE = 16


@dataclass(frozen=True)
class GrammarSpec:
    """What to compile: `kind` is "json_schema", "regex" or "ebnf"; `text` the grammar."""

    kind: str
    text: str
    any_whitespace: bool = True  # JSON: up to JSON_MAX_WHITESPACE between tokens (else none)

    @property
    def what(self) -> str:
        """How an error names it."""
        return {"json_schema": "JSON schema", "regex": "regex", "ebnf": "grammar"}[self.kind]


def grammar_spec(params: StructuredOutputsParams) -> GrammarSpec:
    """The grammar `params` asks for; a StructuredOutputError for what cannot be enforced."""
    if params.whitespace_pattern is not None:
        raise StructuredOutputError(
            "whitespace_pattern is not supported (xgrammar has no whitespace rule); "
            "disable_any_whitespace=true gives JSON without optional whitespace"
        )
    any_whitespace = not params.disable_any_whitespace
    if params.json is not None:
        schema = json.loads(params.json) if isinstance(params.json, str) else params.json
        check_enforceable(schema)
        return GrammarSpec("json_schema", canonical_json(schema), any_whitespace)
    if params.json_object:
        return GrammarSpec("json_schema", JSON_OBJECT_SCHEMA, any_whitespace)
    if params.regex is not None:
        return GrammarSpec("regex", params.regex)
    if params.choice is not None:
        return GrammarSpec("ebnf", choice_grammar(params.choice))
    assert params.grammar is not None  # StructuredOutputsParams holds exactly one kind
    return GrammarSpec("ebnf", params.grammar)


def canonical_json(schema: Any) -> str:
    """One text per schema: no spaces, keys in their given order, non-ASCII kept."""
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


def check_enforceable(schema: Any) -> None:
    """Refuse a schema that uses a keyword xgrammar would ignore, naming the first one."""
    if not isinstance(schema, dict | bool):
        raise StructuredOutputError(
            f"a JSON schema is an object (or true/false), got {type(schema).__name__}"
        )
    first = next(unenforced_keywords(schema, "schema"), None)
    if first is not None:
        path, keyword = first
        raise StructuredOutputError(
            f"{path} uses {keyword!r}, which xgrammar does not enforce; not supported: "
            f"{', '.join(sorted(UNENFORCED_KEYWORDS))}, and minLength or maxLength beside a "
            "pattern (put the length in the pattern: [a-z]{1,8})"
        )


def unenforced_keywords(schema: Any, path: str) -> Iterator[tuple[str, str]]:
    """(where, keyword) for every unenforced keyword in `schema` and its subschemas."""
    if not isinstance(schema, dict):
        return
    for keyword in sorted(UNENFORCED_KEYWORDS & schema.keys()):
        yield path, keyword
    if "pattern" in schema:  # xgrammar keeps the pattern and drops the lengths
        for keyword in sorted({"minLength", "maxLength"} & schema.keys()):
            yield path, f"{keyword} beside pattern"
    for key in _NAMED_SUBSCHEMAS:
        for name, sub in _items(schema.get(key)):
            yield from unenforced_keywords(sub, f"{path}.{key}.{name}")
    for key in _ONE_SUBSCHEMA:
        yield from unenforced_keywords(schema.get(key), f"{path}.{key}")
    for key in _SUBSCHEMA_LISTS:
        subs = schema.get(key)
        for i, sub in enumerate(subs if isinstance(subs, list) else ()):
            yield from unenforced_keywords(sub, f"{path}.{key}[{i}]")


def _items(mapping: Any) -> list[tuple[str, Any]]:
    return list(mapping.items()) if isinstance(mapping, dict) else []


# EBNF string literals: what must be escaped inside "..." (xgrammar reads llama.cpp's GBNF)
_EBNF_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def choice_grammar(choices: list[str]) -> str:
    """`root ::= "a" | "b"`: exactly one of the strings."""
    return "root ::= " + " | ".join(ebnf_literal(c) for c in choices)


def ebnf_literal(text: str) -> str:
    """`text` as an EBNF string literal; other control characters as \\uXXXX."""

    def escaped(char: str) -> str:
        if char in _EBNF_ESCAPES:
            return _EBNF_ESCAPES[char]
        return f"\\u{ord(char):04x}" if ord(char) < 0x20 or ord(char) == 0x7F else char

    return '"' + "".join(map(escaped, text)) + '"'
