"""How much GPU memory the KV pool may take (vLLM's `gpu_memory_utilization`).

    budget = utilization x the device's memory
             - what torch holds at its peak: the weights, plus the activations of the
               largest step (a forward of max_num_batched_tokens tokens, measured)
             - what others hold: the CUDA context, other processes

Everything left is the pool's. The peak is measured, not estimated: the model runs one
forward of the step's token budget as one sequence and torch reports the most it had
allocated. Its attention is causal SDPA (`ProfileAttention`), which on a GPU runs a flash
or memory-efficient kernel, as the Triton prefill kernel does: O(T) memory, never a T x T
score matrix (at 16k tokens an fp32 one is 1 GiB a head), so the figure is the step's real
activations and not an attention the engine never runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minserve.model.llama import CausalLM

GIB = 1 << 30


def kv_cache_budget(total: int, utilization: float, torch_peak: int, others: int) -> int:
    """Bytes left for the KV pool (the rule above); an error with the numbers if none."""
    budget = int(total * utilization) - torch_peak - others
    if budget <= 0:
        raise ValueError(
            f"no GPU memory left for the KV cache: gpu_memory_utilization={utilization} "
            f"allows {total * utilization / GIB:.2f} GiB of {total / GIB:.2f} GiB, and the "
            f"weights with the largest step's activations take {torch_peak / GIB:.2f} GiB, "
            f"other users {others / GIB:.2f} GiB; raise gpu_memory_utilization, or lower "
            "max_num_batched_tokens"
        )
    return budget


def profile_attention(
    layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> torch.Tensor:
    """`AttentionFn` of the profile: one sequence's causal attention, q [T, Hq, D] over k, v
    [T, Hkv, D] -> [T, Hq, D], by SDPA without a mask (flash or memory-efficient on a GPU).
    k and v are widened to the query heads: every SDPA kernel takes that, fp32 included."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)  # [T, Hq, D]
    v = v.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        is_causal=True,
    )  # fmt: skip
    return out[0].transpose(0, 1)  # [T, Hq, D]


@torch.inference_mode()
def profile_forward(model: CausalLM, num_tokens: int, num_logits: int) -> None:
    """One forward of `num_tokens` tokens as one sequence, and the logits of `num_logits`
    rows: the largest step the engine will run."""
    device = next(model.parameters()).device
    input_ids = torch.zeros(num_tokens, dtype=torch.long, device=device)  # [T]
    positions = torch.arange(num_tokens, device=device)  # [T]
    hidden = model(input_ids, positions, profile_attention)  # [T, hidden]
    model.compute_logits(hidden[:num_logits])  # [num_logits, vocab]


def measure_kv_cache_budget(
    model: CausalLM, utilization: float, num_tokens: int, num_logits: int
) -> int:
    """The pool's bytes on the model's GPU: profile the largest step, then apply the rule."""
    device = next(model.parameters()).device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    profile_forward(model, num_tokens, num_logits)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    others = total - free - torch.cuda.memory_reserved(device)
    return kv_cache_budget(total, utilization, peak, others)
