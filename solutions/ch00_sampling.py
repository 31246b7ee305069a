# Generated from minserve/model/sampler.py by `python -m minserve.course.generate`;
# edit the marked regions there, not here.
"""Chapter 00, The model we serve: the sampler's filters (top-k, top-p, min-p).

Each function takes logits [rows, vocab] and one setting per row, and returns new
logits in which the tokens the filter rejects are -inf.
"""

import torch


# Exercise 0.1: top-k filtering
def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep the k largest logits of each row and set the others to -inf.

    Top-k cuts off the long tail: each of 50k unlikely tokens is rare, but together they
    are drawn often enough to derail a generation. `logits` is [rows, vocab]; `top_k` is
    int64 [rows], one k per row, where k <= 0 turns the filter off for that row and
    k >= vocab keeps every token. Tokens tied with the k-th largest logit are all kept (as
    in Hugging Face and vLLM), so the result depends on the values, never on token ids.
    Returns a new tensor; `logits` is left unchanged.
    """
    k = top_k.clamp(min=1, max=logits.shape[-1])  # [rows]
    largest = logits.topk(int(k.max()), dim=-1).values  # [rows, max k], no full sort needed
    kth_largest = largest.gather(-1, (k - 1).unsqueeze(-1))  # [rows, 1]
    kth_largest = kth_largest.masked_fill((top_k <= 0).unsqueeze(-1), float("-inf"))  # off
    return logits.masked_fill(logits < kth_largest, float("-inf"))


# Exercise 0.2: top-p (nucleus) filtering
def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the nucleus: the fewest most-probable tokens whose probabilities sum to >= p.

    Unlike a fixed k, the nucleus follows the model's confidence: one token when it is
    sure, hundreds when it is not (Holtzman et al., 2019). `logits` is [rows, vocab] and
    may already hold -inf (top-k runs first); `top_p` is float [rows] in (0, 1]. The most
    probable token is always kept. Tokens tied with the least probable kept token are kept
    too, so the result depends on the values, never on token ids. p = 1.0 turns the
    filter off: that row comes back unchanged, even tokens whose probability underflows
    to 0 in float32. Tip: in float32, sum the small probabilities first (sort ascending
    and drop the prefix whose cumulative probability is <= 1 - p).
    Returns a new tensor; `logits` is left unchanged.
    """
    sorted_asc = logits.sort(dim=-1).values  # [rows, vocab]
    cumulative = sorted_asc.softmax(dim=-1).cumsum(dim=-1)  # [rows, vocab], ends at 1
    dropped = (cumulative <= 1 - top_p.unsqueeze(-1)) & (top_p < 1).unsqueeze(-1)  # a prefix
    num_dropped = dropped.sum(dim=-1).clamp(max=logits.shape[-1] - 1)  # [rows]; keep >= 1
    smallest_kept = sorted_asc.gather(-1, num_dropped.unsqueeze(-1))  # [rows, 1]
    return logits.masked_fill(logits < smallest_kept, float("-inf"))


# Exercise 0.3: min-p filtering
def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Keep the tokens at least `min_p` times as probable as the most probable one.

    min-p (Nguyen et al., 2024) scales the cut-off with the model's confidence: a peaked
    distribution keeps few tokens, a flat one keeps many. `logits` is [rows, vocab];
    `min_p` is float [rows] in [0, 1], where 0 turns the filter off for that row. No
    softmax is needed: the normaliser cancels in p_i / p_max = exp(logit_i - logit_max),
    so a token is kept exactly when logit_i >= logit_max + log(min_p).
    Returns a new tensor; `logits` is left unchanged.
    """
    max_logit = logits.max(dim=-1, keepdim=True).values  # [rows, 1]
    threshold = max_logit + min_p.log().unsqueeze(-1)  # [rows, 1]; log(0) = -inf keeps all
    return logits.masked_fill(logits < threshold, float("-inf"))
