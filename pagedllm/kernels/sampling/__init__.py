"""Sampling kernels: the greedy argmax, Gumbel noise, sparse penalties and the top-k/top-p threshold search."""
