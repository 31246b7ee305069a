"""Calibrate the simulator: measure prefill and decode step times on the real engine.

Prefill steps of each prompt length, then decode steps of each batch size, timed around
`LLMEngine.step()`; what each step really ran is read back from its scheduler output, so
a measurement never claims a shape the scheduler did not run. `fit_step_costs` turns them
into `StepCosts`.

    python -m minserve.disagg.calibrate --model path/to/model --out costs.json
"""

from __future__ import annotations

import argparse
import itertools
import time
from pathlib import Path

from minserve.disagg.costs import StepCosts, StepMeasurement, fit_step_costs
from minserve.engine import LLMEngine, observe_steps
from minserve.sampling_params import SamplingParams

_ids = itertools.count()


def timed_step(engine: LLMEngine) -> StepMeasurement:
    """One engine step, with what it ran: prompt tokens prefilled and sequences decoded."""
    with observe_steps(engine) as records:
        start = time.perf_counter()
        engine.step()
        seconds = time.perf_counter() - start
    batch = records[-1].scheduler_output
    decodes = sum(1 for c in batch.chunks if c.is_decode)
    return StepMeasurement(batch.num_batched_tokens - decodes, decodes, seconds)


def _add(engine: LLMEngine, prompt_len: int, max_tokens: int) -> None:
    vocab = engine.loaded.config.vocab_size
    prompt = [(7 * i + 3) % vocab for i in range(prompt_len)]  # any valid tokens will do
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    engine.add_request(f"calibrate-{next(_ids)}", None, prompt, params)


def _drain(engine: LLMEngine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def measure_steps(
    engine: LLMEngine,
    prompt_lens: tuple[int, ...] = (32, 128, 512),
    batch_sizes: tuple[int, ...] = (1, 2, 3, 4, 8, 16, 32),
    repeats: int = 3,
    decode_contexts: tuple[int, ...] = tuple(8 + 16 * i for i in range(8)),
) -> list[StepMeasurement]:
    """`repeats` prefill steps per prompt length, `repeats` decode steps per batch size; the
    decoding sequences' prompts cycle through `decode_contexts` (a decode step's cost grows
    with the context it reads: pick them like the workload's prompts)."""
    if engine.has_unfinished_requests():
        raise ValueError("calibrate an idle engine: it has requests in flight")
    budget = engine.scheduler_config.max_num_batched_tokens
    if max(prompt_lens) > budget:
        raise ValueError(f"prompt length {max(prompt_lens)} exceeds one step's {budget} tokens")
    measured = []
    for prompt_len in prompt_lens:
        for _ in range(repeats):
            _add(engine, prompt_len, max_tokens=1)
            measured.append(timed_step(engine))
            _drain(engine)
    for batch in batch_sizes:
        for i in range(batch):  # contexts of different lengths, as in real batches
            _add(engine, decode_contexts[i % len(decode_contexts)], max_tokens=repeats + 1)
        while any(s.num_computed_tokens == 0 for s in engine.scheduler.waiting):
            engine.step()  # the prompts first (a few steps if the budget is small)
        measured += [timed_step(engine) for _ in range(repeats)]
        _drain(engine)
    return measured


def calibrate(engine: LLMEngine, **shapes: tuple[int, ...]) -> StepCosts:
    """Measured step costs of `engine`, with its KV bytes per token (for transfers)."""
    pool = engine.worker.pool
    return fit_step_costs(measure_steps(engine, **shapes), pool.block_nbytes // pool.block_size)


def main() -> None:
    from minserve.llm import LLM

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model path (default: bundled SmolLM2)")
    parser.add_argument("--out", type=Path, required=True, help="where to write the JSON")
    args = parser.parse_args()
    llm = LLM(args.model)
    assert llm.engine is not None
    costs = calibrate(llm.engine)
    costs.save(args.out)
    print(costs)


if __name__ == "__main__":
    main()
