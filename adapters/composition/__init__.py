"""Adapters combined: weighted composition per request (PEFT's cat), composites cached in bytes, and stored merges
run in worker processes."""
