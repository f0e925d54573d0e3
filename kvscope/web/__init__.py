"""The HTTP server: a Quart app on hypercorn over one `Engine`."""
