"""The scheduler loop, admission policy, schedule batch, KV manager and output processing."""
