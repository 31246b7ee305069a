"""Exact greedy tokens through a bfloat16 screen of the output head.

A decode step reads every weight once, and on a CPU that read is the step's cost. The
output head is a fifth of SmolLM2's weights (49152 x 576). For a greedy row only its
argmax matters, and that can be found reading the head in bfloat16, half the bytes:

1. screen: logits A = x . bf16(W) in C (`kernels/bf16_head.c`), summed in fp32;
2. bound: |A_r - E_r| <= M_r for E_r, the fp32 logit whichever order a GEMM sums it in:
   M_r = (||W_r - bf16(W_r)|| + g (||W_r|| + ||bf16(W_r)||)) ||x||, Cauchy-Schwarz on the
   rounding of the weights plus g = H u / (1 - H u), the classic bound on an fp32 dot
   product's rounding over H terms (u = 2^-24);
3. keep the candidates r with A_r + M_r >= max_s (A_s - M_s), in C as well: the fp32
   argmax is always among them. Usually there is one, and it is the answer (9 rows in 10
   for SmolLM2); otherwise the candidates' fp32 logits are computed from the fp32 head and
   the largest wins (the lowest id on a tie, like `argmax`).

The result is the token the fp32 logits pick, not an approximation of it. Greedy parity
with transformers (tests/test_model_parity.py) runs through this path; the CPU runner
owns it (`platforms/cpu/runner.py`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minserve.kernels import cpu_ops

UNIT_ROUNDOFF = 2.0**-24  # fp32
SCREEN_MAX_ROWS = 2  # measured: from 3 rows on the fp32 head (few-row kernel) was faster


class GreedyScreen:
    """The head's weight [vocab, hidden] in bfloat16, and each row's error bound per |x|."""

    def __init__(self, weight: torch.Tensor) -> None:
        vocab, hidden = weight.shape
        self.weight = weight.detach()  # [vocab, hidden] fp32, shared with the head
        rounded = self.weight.to(torch.bfloat16)
        self.bits = rounded.view(torch.int16)  # [vocab, hidden]: what the C kernel reads
        exact, approx = self.weight.double(), rounded.double()
        gamma = hidden * UNIT_ROUNDOFF / (1 - hidden * UNIT_ROUNDOFF)
        slack = (exact - approx).norm(dim=1) + gamma * (exact.norm(dim=1) + approx.norm(dim=1))
        self.slack = (slack * (1 + 2**-16)).float()  # [vocab]; rounded up, never down

    def tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, hidden] fp32 -> the argmax of its fp32 logits [B] (int64)."""
        approx = cpu_ops.bf16_logits(self.bits, hidden)  # [B, vocab]
        x_norm = hidden.norm(dim=1) * (1 + 2**-16)  # [B]; rounded up
        tokens, counts, is_candidate = cpu_ops.screen_candidates(approx, self.slack, x_norm)
        for b in (counts > 1).nonzero().flatten().tolist():  # rare: re-check in fp32
            ids = is_candidate[b].nonzero().flatten()  # ascending: ties go to the lowest id
            exact = F.linear(hidden[b : b + 1], self.weight[ids])  # [1, k] fp32 logits
            tokens[b] = ids[exact.argmax()]
        return tokens


def greedy_screen_for(model: torch.nn.Module) -> GreedyScreen | None:
    """A screen of `model`'s (a CausalLM's) fp32 CPU head; None where none applies. The CPU
    platform builds it where the execution config's `greedy_screen` is on."""
    weight = getattr(model.lm_head, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return None
    if weight.dtype != torch.float32 or not cpu_ops.applies(weight.detach()):
        return None
    return GreedyScreen(weight)


def screens(hidden: torch.Tensor) -> bool:
    """Whether a screen should pick these rows' tokens (otherwise: full logits): a few
    fp32 rows (the head is fp32 wherever a screen is built)."""
    return 0 < hidden.shape[0] <= SCREEN_MAX_ROWS and hidden.dtype == torch.float32
