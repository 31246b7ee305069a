"""Test-wide settings: nothing downloads, and Triton kernels run in the interpreter on CPU."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TRITON_INTERPRET", "1")  # before any @triton.jit runs
