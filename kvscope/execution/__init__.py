"""Running the model: the runner that executes a step, in this process or in a worker
process, its wire, warm-up and checkpoint-gap records (docs/architecture.md)."""
