"""`kvscope bench vllm-tests`: vLLM's own OpenAI-entrypoint tests run against `kvscope
serve` (docs/vllm-tests.md)."""
