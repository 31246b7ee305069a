"""The CPU platform: C kernels, packed linears, the C decode loop, the greedy head screen."""
