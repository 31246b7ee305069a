"""Measuring minserve: decode rates, the memory-bandwidth floor, and peers run side by side.

Benchmarks are programs in `benchmarks/`; the functions they share with the chapters live
here, so a number in a notebook and a number in a report come from the same code.
"""
