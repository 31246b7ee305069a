"""Pictures for the chapters: matplotlib figures built from minserve's real components.

Each helper returns a `matplotlib.figure.Figure` made without pyplot, so nothing depends
on an interactive backend: a notebook displays the returned figure, a script saves it.

- `timeline`: which request ran in which step (prefill or decode, preemptions), and
  inter-token latency over time, from a `minserve.bench.step_trace.StepTrace`
  (chapters 03 and 04).
"""
