"""`kvscope bench cancel`: cancel a share of many streams; every hop of the cancel path.

`command` (options, the run over each server setting), `plans` (what each stream
does), `client` (one stream on aiohttp), `runs` (one server's rounds), `figures`
(records -> figures and targets), `records` (the typed results), `tables`, `plot`.
"""
