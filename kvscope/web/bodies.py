"""Reading a JSON request body into its declared model, with a 400 for anything wrong.

The body is read whole (Quart enforces `MAX_CONTENT_LENGTH`, 413), decoded as UTF-8,
parsed as JSON and validated by the pydantic model; each failure is an `ApiError(400)`
whose message names the field, so malformed input never reaches the engine.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from quart import request

from .errors import ApiError

M = TypeVar("M", bound=BaseModel)


def decode_json(raw: bytes | str) -> Any:
    """Parse a JSON document; `ApiError(400)` if it is not UTF-8 or not JSON."""
    if isinstance(raw, bytes):
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ApiError(400, "the body is not valid UTF-8") from None
    if not raw.strip():
        raise ApiError(400, "the body is empty; send a JSON object")
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise ApiError(400, f"the body is not valid JSON: {exc}") from None


def validate(model: type[M], data: Any) -> M:
    """`data` as a `model`; `ApiError(400)` naming the first bad field."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        message = f"{where}: {first['msg']}" if where else first["msg"]
        raise ApiError(400, message, param=where or None) from None
    except RecursionError:
        raise ApiError(400, "the body is nested too deeply") from None


async def read_body(model: type[M]) -> M:
    """The current request's JSON body as a `model`."""
    return validate(model, decode_json(await request.get_data()))
