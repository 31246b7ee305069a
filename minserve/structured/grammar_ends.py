"""Whether a grammar can end: a rule that only ever recurses never finishes a sentence.

`root ::= "a" root` compiles, and every mask it gives allows "a" and never EOS: the output
runs to `max_tokens`. Such a grammar is refused when it is compiled. A rule is *productive*
when one of its alternatives is a sequence of productive items: a string or a character
class, a productive rule, a group with a productive alternative, or anything repeated zero
or more times (`*`, `?`, `{0, n}`). The productive rules are found by a fixpoint, and the
grammar can end when its root is one of them.

The text read is xgrammar's normalized print of the compiled grammar (every kind of
constraint, a JSON schema included, becomes one), one `name ::= body` per line.
"""

from __future__ import annotations

import re

_TOKEN = re.compile(
    r'\s*(?:(?P<string>"(?:\\.|[^"\\])*")|(?P<cls>\[(?:\\.|[^\]\\])*\])'
    r"|(?P<name>[A-Za-z_][A-Za-z0-9_]*)|(?P<repeat>\{\s*\d+\s*,\s*-?\d+\s*\})"
    r"|(?P<look>\(=)|(?P<op>[()|*+?]))"
)
_REPEAT_MIN = re.compile(r"\{\s*(\d+)")
Item = tuple[str, object]  # ("terminal", None) | ("rule", name) | ("group", alternatives)


def can_end(grammar_text: str, root: str = "root") -> bool:
    """Whether `root` derives a finite text (True too when the text cannot be read here)."""
    rules: dict[str, Alternatives] = {}
    for line in grammar_text.splitlines():
        name, sep, body = line.partition("::=")
        if not sep:
            continue
        tokens = _tokens(body)
        if tokens is None:
            return True
        alternatives, _ = _alternatives(tokens, 0)
        if alternatives is None:
            return True
        rules[name.strip()] = alternatives
    if root not in rules:
        return True
    productive: set[str] = set()
    changed = True
    while changed:
        changed = False
        for name, alternatives in rules.items():
            if name not in productive and _any_ends(alternatives, productive):
                productive.add(name)
                changed = True
    return root in productive


def _tokens(body: str) -> list[tuple[str, str]] | None:
    """(kind, text) of each token, lookahead groups `(= ...)` dropped; None if unreadable."""
    out: list[tuple[str, str]] = []
    position, depth_of_lookahead, depth = 0, None, 0
    while position < len(body):
        if body[position:].strip() == "":
            break
        match = _TOKEN.match(body, position)
        if match is None:
            return None
        position = match.end()
        kind = match.lastgroup or ""
        text = match.group(kind).strip()
        if kind == "look":
            depth_of_lookahead = depth = depth + 1
            continue
        if kind == "op" and text == "(":
            depth += 1
        if depth_of_lookahead is not None:
            if kind == "op" and text == ")":
                depth -= 1
                if depth < depth_of_lookahead:
                    depth_of_lookahead = None
            continue
        if kind == "op" and text == ")":
            depth -= 1
        out.append((kind, text))
    return out


Alternatives = list[list[tuple[Item, bool]]]  # each: a sequence of (item, may be absent)


def _alternatives(tokens: list[tuple[str, str]], i: int) -> tuple[Alternatives | None, int]:
    """Parse `seq | seq | ...` from tokens[i]; (alternatives, next index) or (None, i)."""
    alternatives: Alternatives = [[]]
    while i < len(tokens):
        kind, text = tokens[i]
        if kind == "op" and text == ")":
            return alternatives, i
        if kind == "op" and text == "|":
            alternatives.append([])
            i += 1
            continue
        if kind == "op" and text == "(":
            inner, i = _alternatives(tokens, i + 1)
            if inner is None or i >= len(tokens):
                return None, i
            item: Item = ("group", inner)
        elif kind in ("string", "cls"):
            item = ("terminal", None)
        elif kind == "name":
            item = ("rule", text)
        else:
            return None, i
        i += 1
        optional = False
        if i < len(tokens) and (tokens[i][0] == "repeat" or tokens[i][1] in ("*", "+", "?")):
            quantifier = tokens[i][1]
            optional = quantifier in ("*", "?") or (
                quantifier.startswith("{") and int(_REPEAT_MIN.match(quantifier)[1]) == 0
            )
            i += 1
        alternatives[-1].append((item, optional))
    return alternatives, i


def _any_ends(alternatives: Alternatives, productive: set[str]) -> bool:
    return any(all(_ends(item, opt, productive) for item, opt in seq) for seq in alternatives)


def _ends(item: Item, optional: bool, productive: set[str]) -> bool:
    kind, value = item
    if optional or kind == "terminal":
        return True
    if kind == "rule":
        return value in productive
    return _any_ends(value, productive)  # type: ignore[arg-type]
