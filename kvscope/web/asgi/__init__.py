"""The layers in front of the Quart app, outermost first: the wire (bodiless cancels
and polls answered from their bytes, a patch on hypercorn's HTTP/1.1 protocol), CORS,
the guard that refuses a request before its body is read, and the fast path that
answers a cancel, `/stats` and `/health` below Quart."""
