"""The LoRA adapters an engine serves, and loading and unloading them at run time
(vLLM's `/v1/load_lora_adapter`).

`RuntimeAdapters` owns the table of adapters (name -> directory) that admission checks
a request's `lora` against and the runner reads; the ledger counts the live requests
of each. Loading reads and checks an adapter in a worker thread and hands it to this
process's copy of the model (a model worker process reads it when a step first uses
it); unloading refuses while requests run with it.
"""

from __future__ import annotations

import logging

import anyio

from kvscope.errors import InvalidRequest, RequestConflict, UnknownRequest
from kvscope.models.lora import LoraError, check_adapter_name, read_adapter

from .lifecycle import Ledger
from .parts import Parts

log = logging.getLogger("kvscope.requests")


class RuntimeAdapters:
    def __init__(self, parts: Parts, ledger: Ledger) -> None:
        self.table = parts.adapters  # shared with admission and the runner
        self._parts = parts
        self._ledger = ledger

    def requests(self) -> dict[str, int]:
        """Each LoRA adapter served, and how many live requests run with it."""
        return {name: self._ledger.adapter_users[name] for name in self.table}

    async def load(self, name: str, path: str) -> None:
        """Serve the adapter saved in `path` as `name` from now on. A name in use is a
        `RequestConflict`; an adapter that cannot be served, an `InvalidRequest` saying
        why."""
        parts = self._parts
        try:
            check_adapter_name(name, parts.loaded.name)
        except LoraError as exc:
            raise InvalidRequest(str(exc)) from None
        if name in self.table:
            raise RequestConflict(f"LoRA adapter {name!r} is already loaded")
        config, device, max_rank = parts.loaded.config, parts.device, parts.config.max_lora_rank
        try:
            adapter = await anyio.to_thread.run_sync(
                lambda: read_adapter(name, path, config, device=device, max_rank=max_rank)
            )
        except LoraError as exc:
            raise InvalidRequest(str(exc)) from None
        if name in self.table:  # loaded by another call meanwhile
            raise RequestConflict(f"LoRA adapter {name!r} is already loaded")
        self.table[name] = path
        parts.runner.add_adapter(adapter)  # this process's copy of the model need not read it
        log.info("LoRA adapter %r loaded from %s: rank %d", name, path, adapter.rank)

    def unload(self, name: str) -> None:
        """Stop serving the adapter `name` and free it (a model worker process frees its
        copy with its next step). `UnknownRequest` if it is not loaded;
        `RequestConflict` while requests run with it."""
        if name not in self.table:
            raise UnknownRequest(f"no LoRA adapter {name!r} is loaded")
        users = self._ledger.adapter_users[name]
        if users:
            raise RequestConflict(
                f"LoRA adapter {name!r} has {users} live request(s); cancel them or wait "
                "for them to end"
            )
        del self.table[name]
        self._parts.runner.forget_adapter(name)
        log.info("LoRA adapter %r unloaded", name)
