"""The base model: a Llama-family decoder written in the project, and its weight loaders."""
from loramux.model.config import ModelConfig
from loramux.model.llama import LlamaModel

__all__ = ["ModelConfig", "LlamaModel"]
