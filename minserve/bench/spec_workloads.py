"""The speculative-decoding benchmark's two workloads, built deterministically from text here.

- "repetition": rename one variable in a short piece of Python (two functions, about 20
  lines) and return "the whole function". SmolLM2-135M mostly copies the code back (often
  without doing the rename), so the answer repeats the prompt: where prompt lookup (n-gram)
  speculation shines. Asked to "rewrite" the function, it rewrote it freely instead.
- "chat": open questions through the chat template; the answer copies little.

Each workload has 8 prompts (one batch of 8); batch-1 runs take the first few.
"""

from __future__ import annotations

from typing import Any

# Four functions (about 20 lines each) x two renames = eight rewrite requests.
FUNCTIONS = (
    '''def count_words(text, ignore_case=True, min_length=1):
    """Count how often each word occurs in text."""
    counts = {}
    for line in text.splitlines():
        for word in line.split():
            word = word.strip(".,;:!?")
            if ignore_case:
                word = word.lower()
            if len(word) < min_length:
                continue
            counts[word] = counts.get(word, 0) + 1
    return counts


def most_common(counts, n=10):
    """Return the n most frequent words with their counts."""
    pairs = sorted(counts.items(), key=lambda pair: pair[1], reverse=True)
    return pairs[:n]
''',
    '''def binary_search(items, target):
    """Return the index of target in the sorted list items, or -1."""
    low = 0
    high = len(items) - 1
    while low <= high:
        middle = (low + high) // 2
        if items[middle] == target:
            return middle
        if items[middle] < target:
            low = middle + 1
        else:
            high = middle - 1
    return -1


def insert_sorted(items, value):
    """Insert value into the sorted list items, keeping it sorted."""
    index = 0
    while index < len(items) and items[index] < value:
        index += 1
    items.insert(index, value)
''',
    '''def parse_config(lines):
    """Parse key = value lines into a dictionary, skipping comments."""
    config = {}
    for number, line in enumerate(lines, start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "=" not in line:
            raise ValueError(f"line {number} has no '='")
        key, value = line.split("=", 1)
        config[key.strip()] = value.strip()
    return config


def read_config(path):
    """Read a configuration file and parse its lines."""
    with open(path) as handle:
        lines = handle.readlines()
    return parse_config(lines)
''',
    '''def merge_intervals(intervals):
    """Merge overlapping (start, end) intervals and return them sorted."""
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [tuple(pair) for pair in merged]


def total_length(intervals):
    """Return the total length covered by the intervals."""
    length = 0
    for start, end in merge_intervals(intervals):
        length += end - start
    return length
''',
)
RENAMES = (
    (("counts", "frequencies"), ("word", "token")),
    (("middle", "mid"), ("items", "values")),
    (("config", "settings"), ("number", "line_number")),
    (("merged", "result"), ("length", "covered")),
)

QUESTIONS = (
    "What are the main causes of climate change, and what can individuals do about it?",
    "Explain how a bicycle stays upright while it is moving.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What should I consider when choosing a programming language for a new project?",
    "Describe the water cycle to a ten-year-old.",
    "Why do people enjoy music? Give a few different explanations.",
    "Give me advice on how to prepare for a job interview.",
    "What were the most important inventions of the nineteenth century, and why?",
)


def rewrite_messages(function: str, old: str, new: str) -> list[dict[str, str]]:
    """One rewrite request as a chat: the function, then the one change to make."""
    return [
        {
            "role": "user",
            "content": f"Rename the variable `{old}` to `{new}` in this Python function "
            f"and return the whole function:\n\n```python\n{function}```",
        }
    ]


def repetition_prompts(tokenizer: Any) -> list[list[int]]:
    """Eight rewrite requests (chat template applied): the outputs copy from the prompts."""
    return [
        chat_token_ids(tokenizer, rewrite_messages(f, *rename))
        for f, renames in zip(FUNCTIONS, RENAMES)
        for rename in renames
    ]


def chat_prompts(tokenizer: Any) -> list[list[int]]:
    """Eight open questions (chat template applied): free-form answers."""
    return [chat_token_ids(tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]


def chat_token_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """The prompt `llm.chat(messages)` would run: the chat template, then tokens."""
    return tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True))


WORKLOADS = {"repetition": repetition_prompts, "chat": chat_prompts}
