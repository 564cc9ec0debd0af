"""``@triton.jit`` kernels of kvrepro (host wrappers live one level up, in ``kvrepro.ops``)."""
