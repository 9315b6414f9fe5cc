"""Turning logits into text: per-request sampling parameters, the vectorised sampler and incremental detokenisation
with stop strings."""
