"""Defaults of `loramux draft distill`, shared by the command line and the distillation (torch-free)."""

DEFAULT_LAYERS = 4  # as good as 8 on the measured budget at 3/4 of the cost per token (docs/performance.md)
DEFAULT_LR = 1e-3  # 2e-4 left the held-out KL at 8.0 where 1e-3 reached 5.3 (8 layers; docs/performance.md)
