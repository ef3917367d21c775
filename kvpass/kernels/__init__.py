"""Triton kernels, each next to its pure-PyTorch reference.

Empty in this release: the foundation's operators are exact attention, which runs on PyTorch's
fused SDPA on CUDA (``kvpass.lowerings``). The decode-attention kernel (ART early termination,
paged reads, split-KV), window scoring and page scoring kernels land with their policies.
"""
