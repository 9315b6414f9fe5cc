"""Building an LLMEngine from Settings: model, tokenizer, engine configuration, adapters, calibration."""
from __future__ import annotations

from pathlib import Path

import torch

from loramux.engine.calibration import calibrate_step_cost
from loramux.engine.config import EngineConfig
from loramux.engine.speculation.draft_runner import draft_from_settings


def engine_from_settings(cls, settings, load_adapters: bool = True):
    """`cls` (LLMEngine or a subclass) for `settings`; `load_adapters`: also load LORAMUX_ADAPTERS directly
    (without the registry, as the CLI does). `LLMEngine.from_settings` calls this."""
    from transformers import AutoTokenizer

    from loramux.model.loader import build_model, end_of_turn_ids, resolve_model_dir

    device, dtype = device_and_dtype(settings)
    model_dir = resolve_model_dir(settings.model, Path(settings.cache_dir))
    model, mcfg = build_model(model_dir, dtype, device, settings.max_model_len, settings.quantization)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = EngineConfig.from_settings(settings)
    engine = cls(model, tokenizer, config, end_of_turn_ids(tokenizer, mcfg, model_dir), dtype, device)
    engine.model_name = settings.model
    for name, path in (settings.adapter_dirs() if load_adapters else {}).items():
        engine.load_adapter_dir(path, name)
    draft = draft_from_settings(settings, tokenizer, mcfg, dtype, device, engine.max_model_len)
    if draft is not None:
        engine.set_draft_model(draft)
    heads = medusa_heads_dir(settings)
    if heads is not None and settings.speculative_tokens > 0:
        from loramux.adapters.formats.medusa import load_medusa_dir

        engine.set_medusa_heads(load_medusa_dir(heads, mcfg.hidden_size))
    calibrate_step_cost(engine)
    return engine


def device_and_dtype(settings) -> tuple[torch.device, torch.dtype]:
    """The device and the weights' dtype (the adapter pool's too) an engine built from `settings` uses."""
    from loramux.model.loader import torch_dtype

    device = torch.device("cuda" if settings.device == "auto" and torch.cuda.is_available()
                          else ("cpu" if settings.device == "auto" else settings.device))
    return device, torch_dtype(settings.dtype, device)


def medusa_heads_dir(settings) -> Path | None:
    """The base model's Medusa heads directory LORAMUX_MEDUSA_HEADS names: "auto" = the heads shipped for the
    embedded model when it is served (None for other models), "" = none."""
    from loramux.model.medusa import shipped_medusa_dir
    from loramux.settings import DEFAULT_MODEL

    spec = settings.medusa_heads.strip()
    if spec == "auto":
        shipped = shipped_medusa_dir()
        return shipped if settings.model == DEFAULT_MODEL and (shipped / "medusa_config.json").is_file() else None
    return Path(spec) if spec else None
