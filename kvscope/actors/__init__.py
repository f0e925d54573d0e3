"""The actors: the engine (root nursery), request tasks, the step actor, the scheduler,
the registry and the audit log."""
