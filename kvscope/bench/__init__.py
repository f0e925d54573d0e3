"""Benchmarks: `kvscope bench cancel` and `kvscope bench throughput`."""
