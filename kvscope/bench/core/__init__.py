"""What both benchmarks share: typed records (`records`), machine info (`machine`),
statistics (`stats`, `prometheus`), the light HTTP client (`http`), `kvscope serve` as
a child process (`servers`), prompts (`workload`), the reference model
(`reference_model`), and writing tables and plots (`tables`, `plots`)."""
