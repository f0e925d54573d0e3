"""The audit log: one JSON line per ended request, cancelled or not.

Lines are written when the request's KV blocks are released, so every line carries the
release time. Writes are small, synchronous and flushed at once (one per request, not
per token), so a reader (billing, a test) sees each line as soon as it exists. The
records are also kept in memory, bounded, for `Engine.audit_records()`.
"""

from __future__ import annotations

import json
import logging
import os
from collections import deque
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .request import RequestState

log = logging.getLogger(__name__)


class AuditLog:
    def __init__(self, path: str | Path | None = None, *, keep: int = 10_000) -> None:
        self.path = Path(path) if path is not None else None
        self._file: IO[str] | None = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # Owner only (0600): the log names keys, requests and their sizes.
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            self._file = os.fdopen(fd, "a", encoding="utf-8")
        self.records: deque[dict[str, Any]] = deque(maxlen=keep)
        self.count = 0
        self.failed_writes = 0

    def write(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        self.count += 1
        if self._file is not None:
            try:
                self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
                self._file.flush()
            except OSError as exc:
                # It runs in a request's cleanup: a full disk must not stop the request
                # from publishing its end (a stream or a DELETE would wait forever).
                self.failed_writes += 1
                if self.failed_writes == 1:
                    log.error(
                        "the audit log %s could not be written (%s); lines are lost", self.path, exc
                    )

    def close(self) -> None:
        if self._file is not None:
            file, self._file = self._file, None
            try:
                file.close()
            except OSError:
                pass  # what a failed write left in the buffer; already reported


def record_of(state: RequestState) -> dict[str, Any]:
    """A released request's audit line. Only a cancelled request has a cancel reason
    (a cancel that came after its natural finish changed nothing)."""
    return {
        "id": state.id,
        "parent": state.parent.id if state.parent is not None else None,
        "key": state.owner,
        "finish_reason": state.finish_reason,
        "cancel_reason": state.cancel_reason,
        "cancelled_by": state.cancelled_by,
        "created": state.created_wall,
        "cancelled": state.cancelled_wall,
        "released": state.released_wall,
        "prompt_tokens": state.num_prompt_tokens,
        "generated_tokens": len(state.token_ids),
        "blocks_released": state.blocks_released,
        "error": state.error,
    }
