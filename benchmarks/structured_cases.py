"""The structured-output benchmark's requests: seeded JSON schemas, regexes and choices, each
with a prompt that asks for it and a judge that says whether an output follows it.

The judges are not minserve's: the `jsonschema` package validates a JSON output against its
schema, Python's `re.fullmatch` a regex output, list membership a choice. Every generated
output is short by construction (strings of at most 12 characters, arrays of at most 4
items, at most 8 leaves per schema), so 200 tokens suffice for any of them unless a sample
writes many whitespace characters or non-ASCII characters of several tokens each.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from typing import Any

import jsonschema

from minserve.sampling_params import StructuredOutputsParams

KINDS = ("json", "regex", "choice")


@dataclass(frozen=True)
class Case:
    """One request: `constraint` is a JSON schema (kind "json"), a regex or a list of choices."""

    kind: str
    name: str
    question: str
    constraint: Any

    def params(self, **options: Any) -> StructuredOutputsParams:
        key = {"json": "json", "regex": "regex", "choice": "choice"}[self.kind]
        return StructuredOutputsParams(**{key: self.constraint}, **options)

    def messages(self) -> list[dict[str, str]]:
        """A JSON case is asked in a chat (the schema in the question)."""
        schema = json.dumps(self.constraint)
        return [{"role": "user", "content": f"{self.question} Reply with JSON only, matching "
                 f"this JSON schema: {schema}"}]  # fmt: skip

    def prompt(self) -> str:
        """A regex or choice case is asked as a completion."""
        return f"Question: {self.question}\nAnswer: "

    def judge(self, text: str) -> str | None:
        """None if `text` follows the constraint, else why not."""
        if self.kind == "json":
            try:
                jsonschema.validate(json.loads(text), self.constraint)
            except json.JSONDecodeError as error:
                return f"not JSON: {error}"
            except jsonschema.ValidationError as error:
                return f"invalid: {error.message}"
            return None
        if self.kind == "regex":
            return None if re.fullmatch(self.constraint, text) else "no full match"
        return None if text in self.constraint else "not one of the choices"


# ---------------------------------------------------------------- JSON schemas

NAMES = (
    "name", "title", "city", "country", "age", "count", "score", "price", "rating", "level",
    "color", "size", "status", "tags", "items", "code", "label", "owner", "active", "weight",
    "height", "year", "month", "id", "kind", "unit", "zone", "rank", "note", "team",
)  # fmt: skip
TOPICS = ("a person", "a product", "a city", "a book", "a movie", "a sports team", "an order",
          "a planet", "a recipe", "a song", "a car", "a company")  # fmt: skip
# bounded patterns, no maxLength beside them: xgrammar ignores minLength/maxLength there
PATTERNS = (r"^[a-z]{3,8}$", r"^[A-Z][a-z]{2,7}$", r"^[0-9]{5}$", r"^[A-Z]{2}-[0-9]{3}$",
            r"^#[0-9a-f]{6}$", r"^[a-z]{1,6}_[0-9]{2}$")  # fmt: skip
ENUMS = (["red", "green", "blue"], ["small", "medium", "large"], ["draft", "published"],
         [1, 2, 3, 5, 8], ["north", "south", "east", "west"], [True, False, None])  # fmt: skip
MAX_STRING = 12
MAX_LEAVES = 8


def string_schema(rng: random.Random) -> dict:
    if rng.random() < 0.4:
        return {"type": "string", "pattern": rng.choice(PATTERNS)}
    longest = rng.randint(4, MAX_STRING)
    return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": longest}


def number_schema(rng: random.Random, kind: str) -> dict:
    low = rng.randint(-100, 100)
    return {"type": kind, "minimum": low, "maximum": low + rng.choice((9, 100, 1000))}


def leaf_schema(rng: random.Random) -> dict:
    """A string, integer, number, boolean or enum."""
    pick = rng.choice(("string", "integer", "number", "boolean", "enum"))
    if pick == "string":
        return string_schema(rng)
    if pick in ("integer", "number"):
        return number_schema(rng, pick)
    return {"type": "boolean"} if pick == "boolean" else {"enum": rng.choice(ENUMS)}


def array_schema(rng: random.Random) -> dict:
    low = rng.randint(0, 2)
    item = rng.choice((
        {"type": "integer", "minimum": 0, "maximum": 99},
        {"type": "string", "maxLength": 8},
        {"enum": rng.choice(ENUMS)},
    ))  # fmt: skip
    high = rng.randint(max(low, 1), 4)
    return {"type": "array", "items": item, "minItems": low, "maxItems": high}


def object_schema(rng: random.Random, depth: int, leaves: list[int]) -> dict:
    """An object of 2-5 properties (1-3 when nested), some arrays and (one level) objects;
    `leaves` counts the values generated so far, against MAX_LEAVES."""
    names = rng.sample(NAMES, rng.randint(2, 5) if depth == 0 else rng.randint(1, 3))
    properties: dict[str, dict] = {}
    for name in names:
        if leaves[0] >= MAX_LEAVES:
            break
        roll = rng.random()
        if depth == 0 and roll < 0.2 and leaves[0] + 3 <= MAX_LEAVES:
            properties[name] = object_schema(rng, depth + 1, leaves)
            continue
        properties[name] = array_schema(rng) if roll < 0.4 else leaf_schema(rng)
        leaves[0] += 4 if roll < 0.4 else 1  # an array counts for its longest
    required = [n for i, n in enumerate(properties) if i == 0 or rng.random() < 0.7]
    schema = {"type": "object", "properties": properties, "required": required}
    if rng.random() < 0.5:
        schema["additionalProperties"] = False
    return schema


def json_cases(count: int, seed: int) -> list[Case]:
    rng = random.Random(seed)
    cases = []
    for i in range(count):
        schema = object_schema(rng, 0, [0])
        question = f"Describe {rng.choice(TOPICS)} as a JSON object."
        cases.append(Case("json", f"schema-{i}", question, schema))
    return cases


# ---------------------------------------------------------------- regexes and choices

OCTET = r"(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
REGEXES = {  # name: (what to ask for, regex)
    "date": ("the date of {}, as YYYY-MM-DD",
             r"(19|20)\d{2}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"),
    "us date": ("the date of {}, as MM/DD/YYYY", r"(0[1-9]|1[0-2])/(0[1-9]|[12]\d|3[01])/\d{4}"),
    "time": ("the time of {}, as HH:MM", r"([01]\d|2[0-3]):[0-5]\d"),
    "phone": ("a phone number for {}", r"\(\d{3}\) \d{3}-\d{4}"),
    "intl phone": ("an international phone number for {}", r"\+\d{1,3} \d{3} \d{3} \d{4}"),
    "email": ("an email address for {}", r"[a-z]{2,10}(\.[a-z]{2,10})?@[a-z]{2,10}\.(com|org|net)"),
    "ipv4": ("an IPv4 address for {}", rf"({OCTET}\.){{3}}{OCTET}"),
    "hex color": ("a hex color for {}", r"#[0-9a-f]{6}"),
    "version": ("the version number of {}", r"\d{1,2}\.\d{1,2}\.\d{1,3}"),
    "zip": ("a US zip code for {}", r"\d{5}(-\d{4})?"),
    "plate": ("a license plate for {}", r"[A-Z]{3}-\d{3,4}"),
    "price": ("a price for {}", r"\$\d{1,4}\.\d{2}"),
    "sentence": ("one short sentence about {}", r"[A-Z][a-z]{1,10}( [a-z]{1,10}){2,5}\."),
}  # fmt: skip
SUBJECTS = ("the museum", "my dentist", "the launch", "our office", "the concert", "a bakery",
            "the server", "the meeting", "a hotel", "the library", "the airport")  # fmt: skip
CHOICES = {  # a question per item, its choices
    "sentiment": (["positive", "negative", "neutral"], ("Is this review positive, negative or "
                  "neutral? '{}'",), ("Great food, slow service.", "Never again.", "It was fine.",
                  "Absolutely loved it!")),
    "yes/no": (["yes", "no"], ("{}",), ("Is the sky blue?", "Is fire cold?", "Can fish fly?",
               "Is Paris in France?")),
    "planet": (["Mercury", "Venus", "Earth", "Mars", "Jupiter", "Saturn"], ("{}",),
               ("Which planet is the largest?", "Which planet do we live on?",
                "Which planet is called the red planet?", "Which planet has rings?")),
    "animal": (["mammal", "bird", "fish", "reptile", "amphibian"], ("What kind of animal is {}?",),
               ("a dolphin", "an eagle", "a frog", "a lizard", "a salmon")),
    "weekday": (["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"],
                ("{}",), ("Which day comes after Monday?", "Which day starts the weekend?",
                          "Which day is in the middle of the week?")),
    "certainty": (["certainly", "probably", "not sure", "unlikely"], ("Will {} tomorrow?",),
                  ("it rain", "the sun rise", "prices fall", "the train be late")),
}  # fmt: skip


def regex_cases(count: int, seed: int) -> list[Case]:
    rng = random.Random(seed)
    names = list(REGEXES)
    cases = []
    for i in range(count):
        name = names[i % len(names)]
        ask, regex = REGEXES[name]
        question = f"Give {ask.format(rng.choice(SUBJECTS))}."
        cases.append(Case("regex", f"{name}-{i}", question, regex))
    return cases


def choice_cases(count: int, seed: int) -> list[Case]:
    rng = random.Random(seed)
    names = list(CHOICES)
    cases = []
    for i in range(count):
        name = names[i % len(names)]
        choices, (template,), items = CHOICES[name]
        question = f"{template.format(rng.choice(items))} Answer with one of: {', '.join(choices)}."
        cases.append(Case("choice", f"{name}-{i}", question, choices))
    return cases


def all_cases(num_schemas: int, num_regex: int, num_choice: int, seed: int = 0) -> list[Case]:
    """The seeded requests, JSON first."""
    return [*json_cases(num_schemas, seed), *regex_cases(num_regex, seed + 1),
            *choice_cases(num_choice, seed + 2)]  # fmt: skip


# ---------------------------------------------------------------- jump-forward

LONG_KEYS_SCHEMA = {  # long property names the grammar forces, once the value before is done
    "type": "object",
    "properties": {
        "customer_identification_number": {"type": "integer", "minimum": 0, "maximum": 99999},
        "preferred_communication_channel": {"enum": ["email", "phone", "post"]},
        "account_creation_date_in_utc": {"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}$"},
        "is_subscribed_to_the_newsletter": {"type": "boolean"},
        "shipping_address_postal_code": {"type": "string", "pattern": r"^[0-9]{5}$"},
    },
    "required": [
        "customer_identification_number", "preferred_communication_channel",
        "account_creation_date_in_utc", "is_subscribed_to_the_newsletter",
        "shipping_address_postal_code",
    ],
    "additionalProperties": False,
}  # fmt: skip


def long_keys_cases(count: int) -> list[Case]:
    topics = ("a new customer", "a customer from Ohio", "a loyal customer",
              "a customer who prefers phone calls", "a customer in Texas")  # fmt: skip
    return [Case("json", f"long-keys-{i}", f"Describe {topics[i % len(topics)]} as JSON.",
                 LONG_KEYS_SCHEMA) for i in range(count)]  # fmt: skip
