"""Compute kernels: paged attention (torch reference, Triton, Ascend) and sampling."""
