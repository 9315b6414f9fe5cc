"""The tenant API's routes: OpenAI-compatible (/v1/models, /v1/chat/completions, /v1/completions) and the
native API (/generate, /adapters). Thin: they parse (`loramux.server.intake`) and hand the request to
`loramux.server.serving`."""
