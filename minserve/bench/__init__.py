"""Measuring minserve: decode rates, the memory-bandwidth floor, and peers run side by side.

Benchmarks are programs in `benchmarks/`; the functions they share with the chapters live
here, so a number in a notebook and a number in a report come from the same code.

- `naive`: generation loops, decode rates and the bandwidth floor (chapter 00).
- `offline`: offline throughput, nano-vllm's protocol: the workload and the in-process
  runners (minserve's paged engine and reference path, Hugging Face static batching);
  `vllm_peer` runs the same workload under vLLM's own venv; `offline_suite` runs each peer
  in its own process (`minserve bench offline`); `offline_report` writes JSON, markdown
  and a plot.
- `step_trace`: drive `LLMEngine.step()` and record each step's batch and wall time, and
  each request's token times and inter-token latencies (chapters 03 and 04).
- `chunked_itl` (+ `chunked_itl_report`): running decodes' ITL while long prompts arrive,
  chunked prefill vs not (`minserve bench chunked-itl`); `sched_overhead`: the share of a
  decode step outside the model (`minserve bench scheduler-overhead`); `run_env`: threads,
  load guard and the run record they share.
"""
