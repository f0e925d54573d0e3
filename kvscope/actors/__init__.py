"""The actors: the engine (root nursery, registry and API), the request tasks
(`lifecycle.py`), admission, the step actor, the scheduler, the registry and the
audit log."""
