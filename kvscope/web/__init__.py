"""The HTTP server: a Quart app on hypercorn over one `Engine`.

Here, the server itself and what every route shares: its lifecycle (`serve`, `server`,
`settings`, `vllm_flags`), the app factory (`app`), the shared state (`context`), API
keys (`auth`), errors, body reading (`bodies`) and SSE (`sse`). The routes by protocol:
`native/` (kvscope's own API), `openai/` (OpenAI's API as vLLM serves it, with
`openai/responses/`); the ASGI layers in front of the app in `asgi/`; the model-output
parsers in `parsers/`; metrics, logs and the operator's routes in `ops/`.
"""
