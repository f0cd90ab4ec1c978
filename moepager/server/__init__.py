"""OpenAI-compatible HTTP API over the engine core (protocol schemas, routes, metrics; no engine logic)."""
