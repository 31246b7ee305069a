"""The repository's benchmark records: programs that measure, and the results they wrote.

Each program runs from the repository root as `python -m benchmarks.NAME` and writes
NAME.json and NAME.md (some a plot too) beside itself, headed by the command, date, machine
and load it ran under. The measuring code they share with the `minserve bench` commands and
the chapters lives in the package (`minserve.bench`, `minserve.viz`); what is here is the
record around it: peers run side by side (vLLM, transformers), targets, reports and plots.
"""
