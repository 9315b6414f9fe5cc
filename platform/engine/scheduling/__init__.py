"""Which work runs in the next step: continuous batching, paged KV blocks, fair share between tenants, the step's
cost budget and decode grouping (all torch-free)."""
