"""kvscope's own API: jobs started, listed, watched and cancelled by id (`/generate`,
`/requests`), their SSE and WebSocket streams, the JSON events those carry, and the
request and response bodies, declared once (`schemas.py`)."""
