"""C kernels for the CPU: paged attention and the decoder layer's small ops (fp32)."""
