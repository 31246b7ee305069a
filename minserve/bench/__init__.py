"""`minserve bench ...`: what a user runs to measure minserve, like `vllm bench`.

Each subcommand measures and prints its table (`cli.py` lists them); what it needs to
measure lives here:

- `offline`: offline throughput, nano-vllm's protocol (the workload, minserve's run).
- `serve` (+ `serve_client`, `serve_load`, `serve_metrics`, `serve_workloads`): load-test
  any OpenAI-compatible server with vLLM's `bench serve` definitions (TTFT, TPOT, ITL,
  goodput, Poisson or gamma arrivals).
- `chunked_itl` (+ `chunked_itl_command`): running decodes' ITL while long prompts arrive,
  chunked prefill against not; `sched_overhead`: the share of a decode step outside the
  model.
- `prefix` (+ `prefix_command`): the radix cache on against off, cache-aware against FCFS;
  `router`: cache-aware routing against round robin over replicas.
- `speculative` (+ `spec_runs`, `spec_workloads`, `speculative_command`): speculative
  decoding against plain, next to the formulas.
- `disagg` (+ `disagg_goodput`, `disagg_plan`, `disagg_tables`, `disagg_transfer`,
  `disagg_workload`): KV transfer cost, the simulator against a measured pair, colocated
  against 1P1D, capacity plans.
- `checkpoint`, `options`: the model each engine runs; options the commands share.

The repository's records (peers run side by side, targets, JSON, markdown and plots) are
programs in `benchmarks/` built on these; the chapters' measurements are in `minserve.viz`.
"""
