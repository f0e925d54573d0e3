"""OpenAI's API as vLLM serves it: completions and chat (`completions.py`, run by
`run.py`, streamed by `stream.py`, shown by `format.py`), embeddings, the Responses
API (`responses/`), and vLLM's own routes beside them (tokenize, score and rerank,
runtime LoRA loading, SageMaker's contract)."""
