"""CPU kernels: C compiled at first use (AVX2 + FMA, OpenMP) and called through ctypes on torch tensors' memory."""
