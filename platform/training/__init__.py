"""Making speculators for the served model: self-distilled answers, Medusa heads, distilled draft models."""
