"""Text a client sends: it must be valid Unicode before anything tokenizes, renders or
echoes it.

JSON may carry a lone surrogate (`"\\ud800"`), which Python decodes into a `str` that
no UTF-8 codec (the tokenizers' included) accepts. `utf8_size` is the one check, and
measures the text in bytes on the way, so that a size limit applies before tokenizing.
"""

from __future__ import annotations

from kvscope.errors import InvalidRequest


def utf8_size(text: str, what: str, *, field: str | None = None) -> int:
    """The UTF-8 size of `text` in bytes; `InvalidRequest` naming `what` (about the
    request's `field`) if it holds a lone surrogate."""
    if text.isascii():
        return len(text)
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise InvalidRequest(
            f"{what} is not valid Unicode: a lone surrogate at character {exc.start}",
            field=field,
        ) from None
