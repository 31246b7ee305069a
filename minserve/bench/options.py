"""Command-line values the `minserve bench` commands share: comma-separated lists, checked,
and torch's thread count."""

from __future__ import annotations


def choices(text: str, allowed: tuple[str, ...], what: str) -> tuple[str, ...]:
    """Split a comma-separated option and check each item against `allowed`."""
    items = tuple(item.strip() for item in text.split(",") if item.strip())
    unknown = [item for item in items if item not in allowed]
    if unknown or not items:
        raise ValueError(f"unknown {what} {', '.join(unknown)!r}; choose from {', '.join(allowed)}")
    return items


def numbers(text: str, kind: type) -> tuple:
    """A comma-separated option as numbers of `kind` (int or float)."""
    try:
        return tuple(kind(x) for x in text.split(",") if x.strip())
    except ValueError as e:
        raise ValueError(f"expected comma-separated numbers, got {text!r}") from e


def positive_ints(text: str, flag: str) -> list[int]:
    """A comma-separated option of positive integers (batch sizes, budgets)."""
    sizes = [int(x) for x in text.split(",") if x.strip().isdigit()]
    if not sizes or min(sizes) < 1 or len(sizes) != len(text.split(",")):
        raise ValueError(f"{flag} must be positive integers, comma-separated; got {text!r}")
    return sizes


def set_threads(threads: int | None) -> None:
    """torch's intra-op threads for the measurement (None: leave torch's default)."""
    if threads is None:
        return
    if threads < 1:
        raise ValueError(f"--threads must be at least 1, got {threads}")
    import torch

    torch.set_num_threads(threads)
