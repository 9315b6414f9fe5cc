"""A tenant's request from admission to its ledger record: rate limits and concurrency, adapter fallback,
`n` sibling sequences, the engine's outputs, the ledger record, and the server's metrics."""
