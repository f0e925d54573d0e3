"""What a model wrote, read in the format it was trained on: tool calls
(`--tool-call-parser`) and reasoning (`--reasoning-parser`). Protocol-free: the routes
of every API use them, and they import nothing of the server."""
