"""Watching the server run: `/stats`, `/metrics` (Prometheus, with vLLM's names too),
`/health` and `/ready`, the periodic stats line in the log, the event loop's lag, and
the live dashboard (its static page in `dashboard/`)."""
