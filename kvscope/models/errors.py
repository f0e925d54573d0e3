"""`ModelLoadError`: the one error loading a model raises, naming what is wrong."""

from __future__ import annotations

from kvscope.errors import KvscopeError


class ModelLoadError(KvscopeError, ValueError):
    """The model named cannot be loaded; the message says why (which file, which
    tensor, which setting)."""
