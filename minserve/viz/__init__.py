"""What the chapters show: measurements on minserve's real components, and their pictures.

Pictures are `matplotlib.figure.Figure`s made without pyplot, so nothing depends on an
interactive backend: a notebook displays the returned figure, a script saves it.

- `naive` + `plots`: generation loops, decode rates and the bandwidth floor; next-token
  distributions and the sampler's filters (chapter 00).
- `kv_utilization` + `kvcache`: tokens stored over KV slots reserved, paged against
  contiguous; block tables drawn (chapter 01).
- `tile_walk`: which slots of the paged pool a Triton kernel read, load by load, recorded
  in the interpreter, with a slider over the loads (chapter 02).
- `kernel_timing`, `linear_timing` + `backends`: attention backends and a decode step's
  linears timed side by side (chapter 02).
- `step_trace` + `timeline`: drive `LLMEngine.step()` and record every step; which request
  ran in which step, and inter-token latency over time (chapters 03 and 04).
- `radix`: the radix prefix cache drawn (chapter 05).

The benchmarks in `benchmarks/` reuse these measurements, so a number in a notebook and a
number in a report come from the same code.
"""
