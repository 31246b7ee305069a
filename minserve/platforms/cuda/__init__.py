"""The CUDA platform: Triton kernels compiled, step inputs staged in page-locked memory."""
