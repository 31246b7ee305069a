"""Prompt logprobs: how likely the model found each prompt token, given the ones before it.

The logits at position p predict token p + 1, so a prefill chunk that keeps the logits of
its positions scores the prompt's next tokens. The distribution is the model's own: a
float32 log-softmax of the raw logits, before temperature or penalties (vLLM's default).
Each scored token gets its logprob, its rank among the vocabulary (1 + how many tokens are
at least as likely besides it: vLLM's count) and the `k` most likely tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from minserve.messages import PromptLogprobs, ScheduledChunk


def score_prompt_chunks(
    chunks: Sequence[ScheduledChunk], logits: torch.Tensor
) -> dict[str, PromptLogprobs]:
    """Each chunk's `PromptLogprobs`, by request id; `logits` [num_rows, vocab] holds the
    rows of every chunk's `prompt_targets`, chunk after chunk."""
    if not chunks:
        return {}
    logprobs = logits.float().log_softmax(dim=-1)  # [num_rows, vocab]
    targets = torch.tensor(
        [t for c in chunks for t in c.prompt_targets], dtype=torch.long, device=logits.device
    )
    chosen = logprobs.gather(-1, targets.unsqueeze(-1))  # [num_rows, 1]
    ranks = (logprobs >= chosen).sum(dim=-1)  # [num_rows]
    k = min(max(c.prompt_logprobs for c in chunks), logprobs.shape[-1])
    top_values, top_ids = logprobs.topk(k, dim=-1)  # [num_rows, k] each
    columns = (chosen.squeeze(-1), ranks, top_values, top_ids)
    chosen_l, ranks_l, top_values_l, top_ids_l = (t.tolist() for t in columns)
    scored, row = {}, 0
    for c in chunks:
        rows = slice(row, row + len(c.prompt_targets))
        row = rows.stop
        k = c.prompt_logprobs
        scored[c.request_id] = PromptLogprobs(
            first=c.start + 1,
            token_ids=c.prompt_targets,
            logprobs=tuple(chosen_l[rows]),
            ranks=tuple(ranks_l[rows]),
            top_ids=tuple(tuple(ids[:k]) for ids in top_ids_l[rows]),
            top_logprobs=tuple(tuple(v[:k]) for v in top_values_l[rows]),
        )
    return scored
