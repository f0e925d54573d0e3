"""When Serve starts stopping this replica (a rolling redeploy, a scale-down, a delete).

Serve stops a replica in two steps: first it waits, every
`graceful_shutdown_wait_loop_s`, until the replica has no ongoing call (for at most
`graceful_shutdown_timeout_s`, then it kills the actor), and only then runs its
destructor, which ends the ASGI lifespan. A stream outlives that wait: it is an
ongoing call until its last event, so without more it runs until the kill cuts it.
The single server's SIGTERM instead drains at once: refuse new work, let live
requests run for `--drain-timeout`, cancel the rest (`shutdown`) with a last event.

Serve gives a replica no public "you are stopping" signal, so `serve_stopping()`
reads the flag Serve sets on the replica when its graceful shutdown begins (through
the callback Serve put in the replica context, tested on Ray 2.60). `ReplicaApp`
polls it and drains then; its ongoing calls end with their last events, and Serve's
own wait ends. On a Ray where the flag is not found, the replica drains when the
lifespan ends (after Serve's wait), as before, and says so once in its log.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

log = logging.getLogger("kvscope.replicas")


def serve_stopping() -> Callable[[], bool] | None:
    """A check of "Serve began stopping this replica", or None where it cannot tell."""
    try:
        from ray.serve import context

        callback = context._get_internal_replica_context()._handle_registration_callback
        replica = next(
            cell.cell_contents
            for cell in callback.__closure__ or ()
            if hasattr(cell.cell_contents, "_shutting_down")
        )
    except Exception:  # another Ray: no such context, callback or flag
        log.warning(
            "this Ray Serve does not show when it stops a replica: streams drain only "
            "after Serve's own wait (graceful_shutdown_timeout_s)"
        )
        return None
    return lambda: bool(replica._shutting_down)
