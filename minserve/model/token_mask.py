"""Token bitmasks: which vocabulary entries a grammar allows next, 32 tokens to an int32.

A grammar library answers "which tokens may come next?" with one bit per token: bit j of
word w is token 32 w + j (6 KB a row for SmolLM2's 49k tokens instead of 49k booleans).
The sampler turns each constrained row's forbidden tokens into -inf before anything else
reads the logits (`minserve/model/sampler.py`), so greedy, seeded and filtered sampling,
penalties and logprobs all see the constrained distribution.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

BitmaskFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (logits, bitmask) -> logits


def bitmask_words(vocab: int) -> int:
    """int32 words a row of a `vocab`-token bitmask takes."""
    return (vocab + 31) // 32


# >>> exercise 12.1: apply a token bitmask to the logits
def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Set every token a row's bitmask forbids to -inf.

    `logits` is float [rows, vocab]; `bitmask` is int32 [rows, ceil(vocab / 32)], where bit
    j of word w (counting from the least significant bit, the sign bit being bit 31) says
    whether token 32 w + j is allowed. Bits past `vocab` in the last word are ignored.
    Returns a new tensor on the logits' device; `logits` is left unchanged.
    """
    # >>> solution
    vocab = logits.shape[-1]
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)  # [32]
    bits = (bitmask.to(logits.device).unsqueeze(-1) >> shifts) & 1  # [rows, words, 32]
    allowed = bits.flatten(1)[:, :vocab].bool()  # [rows, vocab]
    return logits.masked_fill(~allowed, float("-inf"))
    # <<< solution


# <<< exercise
