"""The errors kvscope raises to its callers; the web layer maps each to a status."""

from __future__ import annotations


class KvscopeError(Exception):
    """Base of kvscope's own errors."""


class InvalidRequest(KvscopeError, ValueError):
    """The request is malformed or cannot fit the model (HTTP 400). `field` names the
    request field it is about, where there is one (a `SamplingParams` field, or
    `prompt`): the web layer answers it as the 400's `param`."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class UnknownRequest(KvscopeError, LookupError):
    """No request has this id, or the caller may not see it (HTTP 404)."""


class RequestConflict(KvscopeError):
    """The request is in a state that forbids the action, e.g. its parent ended (HTTP 409)."""


class EngineOverloaded(KvscopeError):
    """Too many requests are queued; retry later (HTTP 429)."""


class EngineClosed(KvscopeError):
    """The engine is shutting down and takes no new requests (HTTP 503)."""
