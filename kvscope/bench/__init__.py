"""Benchmarks: `kvscope bench cancel`, `kvscope bench throughput`, `kvscope bench report`.

`core/` is what both share (typed records, machine info, statistics, the light HTTP
client, servers, prompts, the reference model, tables, plots); `cancel/` and
`throughput/` are one command each; `report` reads saved results back. Nothing here is
imported by the rest of kvscope except `cli` (and only when `kvscope bench` runs).
"""
