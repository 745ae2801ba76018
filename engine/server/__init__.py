"""The HTTP server: OpenAI and native routes, control plane, protocol, metrics."""
