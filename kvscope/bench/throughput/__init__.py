"""`kvscope bench throughput`: output tokens/s, kvscope served against its peers.

`command` (options and phases), `engine_run` (the engine in-process), `http_level` (a
served level on the light client), `hf_peer` and `vllm_peer` (the peers, imported only
when their phase runs), `headline` (the targets), `records`, `tables`, `plot`.
"""
