"""Per-GPU tuning of the Triton kernels (search space, tuner, cache)."""
