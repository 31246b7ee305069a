"""Whether a grammar can end: a rule that only ever recurses never finishes a sentence.

`root ::= "a" root` compiles, and every mask it gives allows "a" and never EOS: the output
runs to `max_tokens`. Such a grammar is refused when it is compiled. A rule is *productive*
(or "fruitful": it derives some finite text) when one of its alternatives is a sequence of
items that each end: a string or a character class, a productive rule, a group with such
an alternative, or anything repeated zero or more times (`*`, `?`, `{0, n}`). The
productive rules are found by a fixpoint, and the grammar can end when its root is one of
them (exercise 12.5).

The text read is xgrammar's normalized print of the compiled grammar (every kind of
constraint, a JSON schema included, becomes one), one `name ::= body` per line:

    root ::= (("a" root) | (root_1{0, 3}))
    root_1 ::= (([a-z] root_1) | ([a-z])) (=("b"))

A body is read in two steps: `rule_tokens` splits it into tokens (and drops lookahead
assertions `(= ...)`, which say what may follow, not what the rule derives), then
`parse_alternatives` builds its `Alternatives`: a list of sequences, each a list of
(item, may be absent) pairs, an item being ("terminal", None), ("rule", name) or
("group", its own alternatives). The body `"a" root | x{0, 3}` reads as

    [[(("terminal", None), False), (("rule", "root"), False)], [(("rule", "x"), True)]]

and xgrammar's print, which puts the body and each alternative in parentheses, as one
group whose alternatives are groups.
"""

from __future__ import annotations

import re

_TOKEN = re.compile(
    r'\s*(?:(?P<string>"(?:\\.|[^"\\])*")|(?P<cls>\[(?:\\.|[^\]\\])*\])'
    r"|(?P<name>[A-Za-z_][A-Za-z0-9_]*)|(?P<repeat>\{\s*\d+\s*,\s*-?\d+\s*\})"
    r"|(?P<look>\(=)|(?P<op>[()|*+?]))"
)
Token = tuple[str, str]  # (kind, text): kind "string", "cls", "name", "repeat" or "op"
Item = tuple[str, object]  # ("terminal", None) | ("rule", name) | ("group", alternatives)
Alternatives = list[list[tuple[Item, bool]]]  # each: a sequence of (item, may be absent)


def rule_tokens(body: str) -> list[Token] | None:
    """(kind, text) of each token of a rule's body, lookahead groups `(= ...)` dropped;
    None if unreadable. Ops are "(", ")", "|", "*", "+" and "?"; a repeat is "{m, n}"."""
    out: list[Token] = []
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
        if (kind, text) == ("op", "("):
            depth += 1
        if depth_of_lookahead is not None:
            if (kind, text) == ("op", ")"):
                depth -= 1
                if depth < depth_of_lookahead:
                    depth_of_lookahead = None
            continue
        if (kind, text) == ("op", ")"):
            depth -= 1
        out.append((kind, text))
    return out


# >>> exercise 12.5: whether a grammar can end (its productive rules)
def can_end(grammar_text: str, root: str = "root") -> bool:
    """Whether `root` derives a finite text. Read each `name ::= body` line (lines without
    "::=" are skipped) into its alternatives: `rule_tokens`, then `parse_alternatives` from
    token 0, which must consume every token; then look for `root` among the
    `productive_rules`. True when the text cannot be read here (a body whose tokens or
    structure make no sense, or no rule named `root`): a grammar is refused only on proof
    that it never ends."""
    # >>> solution
    rules: dict[str, Alternatives] = {}
    for line in grammar_text.splitlines():
        name, sep, body = line.partition("::=")
        if not sep:
            continue
        tokens = rule_tokens(body)
        if tokens is None:
            return True
        alternatives, end = parse_alternatives(tokens, 0)
        if alternatives is None or end != len(tokens):
            return True
        rules[name.strip()] = alternatives
    return root not in rules or root in productive_rules(rules)
    # <<< solution


def parse_alternatives(tokens: list[Token], i: int) -> tuple[Alternatives | None, int]:
    """Parse `seq | seq | ...` from `tokens[i]` up to a ")" that closes it or the end:
    (its alternatives, the index of that ")" or len(tokens)); (None, i) where a token makes
    no sense (an op where an item should be, a "(" never closed). Each alternative is a
    list of (item, may be absent) pairs. An item is a string or a character class
    ("terminal", None), a rule's name ("rule", name), or a group "(" ... ")" ("group", its
    alternatives, parsed by recursion), then at most one quantifier: after `*`, `?` or a
    repeat "{0, n}" the item may be absent; after `+` or "{m, n}" with m > 0 it may not."""
    # >>> solution
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
            inner, i = parse_alternatives(tokens, i + 1)
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
                quantifier.startswith("{") and int(quantifier[1:].split(",")[0]) == 0
            )
            i += 1
        alternatives[-1].append((item, optional))
    return alternatives, i
    # <<< solution


def productive_rules(rules: dict[str, Alternatives]) -> set[str]:
    """The names of the rules that derive a finite text, by a fixpoint: a rule becomes
    productive once one of its alternatives is a sequence whose every item may be absent
    or ends (a terminal, a rule already productive, a group with such an alternative); go
    over all the rules again until a pass adds none. A rule named but not defined is not
    productive."""
    # >>> solution
    productive: set[str] = set()
    changed = True
    while changed:
        changed = False
        for name, alternatives in rules.items():
            if name not in productive and _any_ends(alternatives, productive):
                productive.add(name)
                changed = True
    return productive


def _any_ends(alternatives: Alternatives, productive: set[str]) -> bool:
    return any(all(_ends(item, opt, productive) for item, opt in seq) for seq in alternatives)


def _ends(item: Item, optional: bool, productive: set[str]) -> bool:
    kind, value = item
    if optional or kind == "terminal":
        return True
    if kind == "rule":
        return value in productive
    return _any_ends(value, productive)  # type: ignore[arg-type]
    # <<< solution


# <<< exercise
