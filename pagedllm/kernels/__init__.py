"""Every Triton kernel of the engine, with its launch wrapper. A kernel module imports torch, triton and
other kernel modules only; the policy of when to use a kernel (float8 or not, which layer) is an argument
given by its caller in layers/, attention/ or sample/."""
