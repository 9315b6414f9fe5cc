"""PEFT's saved copies of the base weights (`embed_tokens.base_layer.weight`, `lm_head.base_layer.weight`) are
accepted only where PEFT 0.21 writes them (next to an embed_tokens LoRA; the head's on a tied model with
ensure_weight_tying), refused by name anywhere else; a copy that differs from the base serves exactly as
PEFT loads it (a replacement embedding / head), and the upload summary counts it, so a composition naming
such an adapter is refused from the summary before anything is loaded."""
from __future__ import annotations

import asyncio
import json
import warnings
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load, save

from conftest import make_engine, run_to_completion
from loramux.adapters.formats.heads import EMBED, HEAD
from loramux.adapters.formats.peft import load_adapter_dir
from loramux.adapters.formats.summary import describe
from loramux.adapters.formats.validation import AdapterValidationError, UploadLimits, validate_adapter_files
from loramux.engine.sampling.params import SamplingParams
from loramux.testing import save_tiny_hf_model, write_peft_adapter

FILES = ("adapter_config.json", "adapter_model.safetensors")
NEW_TOKENS = 6
PROMPTS = [[5, 900, 1200, 77, 4000, 9], [31000, 12, 12, 640, 7]]
LIMITS = UploadLimits(max_total_bytes=1 << 30)
# name: (LoraConfig keyword arguments, the model ties its embeddings, give the base copy trained values)
CASES = {
    "emb": (dict(target_modules=["q_proj", "embed_tokens"]), False, False),
    "emb-trained-base": (dict(target_modules=["q_proj", "embed_tokens"]), False, True),
    "tied-ewt-trained-base": (dict(target_modules=["q_proj", "embed_tokens"], ensure_weight_tying=True), True, True),
}


def _peft_greedy(model_dir, adapter_dir) -> list[list[int]]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    base.generation_config.eos_token_id = None
    base.generation_config.pad_token_id = 0
    model = PeftModel.from_pretrained(base, adapter_dir).eval()
    with torch.inference_mode():
        return [model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(ids):].tolist()
                for ids in PROMPTS]


@pytest.fixture(scope="module")
def world(tmp_path_factory, tokenizer):
    """{tied: (model dir, model config)}, {case: adapter dir}, {case: PEFT's greedy tokens}."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from loramux.model.loader import read_model_config

    root = tmp_path_factory.mktemp("base-copies")
    models = {}
    for tied in (False, True):
        model_dir = root / f"model-{'tied' if tied else 'untied'}"
        save_tiny_hf_model(model_dir, len(tokenizer), weight_scale=4.0, tokenizer=tokenizer, tie_word_embeddings=tied)
        models[tied] = (model_dir, read_model_config(model_dir)[0])
    dirs, expected = {}, {}
    for seed, (name, (kwargs, tied, trained)) in enumerate(CASES.items()):
        hf = AutoModelForCausalLM.from_pretrained(models[tied][0], dtype=torch.float32)
        torch.manual_seed(300 + seed)
        with warnings.catch_warnings():  # PEFT warns that it saves the embedding layers: that is the point
            warnings.simplefilter("ignore")
            peft = get_peft_model(hf, LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, **kwargs))
            if trained:  # the base embedding was trained too (unfrozen): PEFT saves it and loads it over the base
                with torch.no_grad():
                    weight = peft.get_input_embeddings().base_layer.weight
                    weight.add_(torch.randn_like(weight) * weight.std())
                    for param_name, param in peft.named_parameters():  # a small LoRA: the copy's effect shows
                        if "lora_embedding_B" in param_name:
                            param.mul_(0.05)
            peft.save_pretrained(root / name)
            dirs[name] = root / name
            expected[name] = _peft_greedy(models[tied][0], dirs[name])
            if trained:  # what PEFT serves without the copies: must differ, or serving them proves nothing
                bare = root / f"{name}-bare"
                bare.mkdir()
                (bare / FILES[0]).write_bytes((dirs[name] / FILES[0]).read_bytes())
                tensors = load((dirs[name] / FILES[1]).read_bytes())
                (bare / FILES[1]).write_bytes(save({k: v for k, v in tensors.items() if "base_layer" not in k}))
                expected[f"{name}-bare"] = _peft_greedy(models[tied][0], bare)
    return models, dirs, expected


def _files(path) -> dict[str, bytes]:
    return {f: (path / f).read_bytes() for f in FILES}


def _with(files: dict, config: dict | None = None, extra: dict | None = None) -> dict:
    out = dict(files)
    if config is not None:
        out["adapter_config.json"] = json.dumps({**json.loads(files["adapter_config.json"]), **config}).encode()
    if extra is not None:
        out["adapter_model.safetensors"] = save({**load(files["adapter_model.safetensors"]), **extra})
    return out


def _refused(files: dict, cfg) -> AdapterValidationError:
    with pytest.raises(AdapterValidationError) as info:
        validate_adapter_files(files, cfg, LIMITS)
    return info.value


# --------------------------------------------------------------------------------------------- refusals

@pytest.mark.parametrize("tied, config, stray, why", [
    # a plain q_proj LoRA: nothing in the config explains a copy of either base weight
    (False, None, "base_model.model.lm_head.base_layer.weight", "does not ask for that"),
    (True, None, "base_model.model.lm_head.base_layer.weight", "does not ask for that"),
    (False, None, "base_model.model.model.embed_tokens.base_layer.weight", "asks for none"),
    (False, {"modules_to_save": ["lm_head"]}, "base_model.model.lm_head.base_layer.weight", "does not ask for that"),
    # PEFT wraps the head (and saves its base weight) only on a tied model with ensure_weight_tying
    (False, {"target_modules": ["q_proj", "embed_tokens"], "ensure_weight_tying": True},
     "base_model.model.lm_head.base_layer.weight", "does not tie its embeddings"),
    (True, {"target_modules": ["q_proj", "embed_tokens"]}, "base_model.model.lm_head.base_layer.weight",
     "does not ask for that"),
], ids=["untied", "tied", "embed-copy", "modules-to-save", "untied-ewt", "tied-no-ewt"])
def test_a_stray_base_copy_is_refused_naming_it(world, tmp_path, tied, config, stray, why):
    models, _, _ = world
    cfg = models[tied][1]
    files = _files(write_peft_adapter(tmp_path / "plain", cfg, 4, ["q_proj"], seed=3))
    extra = {stray: torch.randn(cfg.vocab_size, cfg.hidden_size)}
    if config and "embed_tokens" in config.get("target_modules", []):
        extra["base_model.model.model.embed_tokens.lora_embedding_A"] = torch.randn(4, cfg.vocab_size)
        extra["base_model.model.model.embed_tokens.lora_embedding_B"] = torch.randn(cfg.hidden_size, 4)
    if config and config.get("modules_to_save"):
        extra["base_model.model.lm_head.modules_to_save.weight"] = torch.randn(cfg.vocab_size, cfg.hidden_size)
    err = _refused(_with(files, config=config, extra=extra), cfg)
    assert err.code == "unknown_tensor", (err.code, str(err))
    message = str(err)
    assert stray in message and why in message and "save_embedding_layers=False" in message, message
    assert "modules_to_save" in message  # what config would train that module in full


def test_a_plain_copy_without_modules_to_save_names_the_saving_option(world, tmp_path):
    """`save_pretrained(..., save_embedding_layers=True)` writes `lm_head.weight` / `embed_tokens.weight` that no
    config field records: refused by name, saying how to save without them."""
    models, _, _ = world
    cfg = models[False][1]
    files = _files(write_peft_adapter(tmp_path / "plain", cfg, 4, ["q_proj"], seed=3))
    err = _refused(_with(files, extra={"base_model.model.lm_head.weight": torch.randn(cfg.vocab_size,
                                                                                      cfg.hidden_size)}), cfg)
    assert err.code == "unknown_tensor" and "lm_head.weight" in str(err)
    assert "save_embedding_layers=False" in str(err)


# --------------------------------------------------------------------------------------------- accepted

def test_peft_copies_are_accepted_and_counted_in_the_summary(world):
    models, dirs, _ = world
    for name, (_, tied, _) in CASES.items():
        cfg = models[tied][1]
        names = set(load((dirs[name] / "adapter_model.safetensors").read_bytes()))
        assert "base_model.model.model.embed_tokens.base_layer.weight" in names, name  # PEFT really wrote it
        assert ("base_model.model.lm_head.base_layer.weight" in names) == tied, name
        adapter = load_adapter_dir(dirs[name], cfg)
        assert f"{EMBED}.base" in adapter.heads and (f"{HEAD}.base" in adapter.heads) == tied
        summary = describe(adapter, cfg, 2)
        v, h = cfg.vocab_size, cfg.hidden_size
        if tied:  # the copy replaces the tied table: the head is the slot's embedding, no bytes of its own
            assert summary["heads"] == ["embed_tokens (saved base copy)", "lm_head (tied to embed_tokens, saved base "
                                        "copy)", "lm_head (embedding LoRA, tied)"], summary["heads"]
        else:
            assert summary["heads"] == ["embed_tokens (saved base copy)"], summary["heads"]
        assert summary["device_bytes"]["heads"] == v * h * 2 and summary["embedding"] == {"rank": 4}
        assert f"{EMBED}.base" in adapter.heads  # the summary left the adapter as it was


def test_copies_serve_exactly_like_peft(world, tokenizer):
    """Equal to the base, the copy is dropped at load; trained, it replaces the embedding (and a tied head)."""
    models, dirs, expected = world
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    for tied in (False, True):
        names = [name for name, (_, ties, _) in CASES.items() if ties == tied]
        engine = make_engine(models[tied][0], tokenizer, max_lora_rank=8, adapter_pool_bytes=1 << 28)
        for name in names:
            engine.load_adapter_dir(dirs[name], name)
        jobs = [(ids, params, name) for name in [None, *names] for ids in PROMPTS]
        outs = run_to_completion(engine, jobs)
        got = {(name, i): out.token_ids for (_, _, name), i, out in zip(jobs, [0, 1] * (len(names) + 1), outs)}
        for name in names:
            assert [got[(name, i)] for i in range(len(PROMPTS))] == expected[name], name
            if CASES[name][2]:
                assert expected[name] != expected[f"{name}-bare"], name  # the trained copy changes the output
        for name in names:
            adapter = engine.adapters.lookup(name)
            assert f"{EMBED}.base" not in adapter.heads and (EMBED in adapter.heads) == CASES[name][2], name


# --------------------------------------------------------------------------------------------- composition

def test_a_composition_naming_it_is_refused_from_the_summary(world, tmp_path):
    """At request time, a 400 from the stored summary: nothing is loaded."""
    from loramux.adapters.storage.registry import AdapterRegistry
    from loramux.adapters.storage.store import FileStore
    from loramux.db import Database
    from loramux.server.http.errors import ApiError
    from loramux.server.intake.composition import Component
    from loramux.server.serving import composition_choice
    from loramux.server.serving.composition_choice import resolve_components

    models, dirs, _ = world
    model_dir, cfg = models[False]
    db = Database(f"sqlite:///{tmp_path / 'registry.db'}")
    db.upgrade()
    try:
        registry = AdapterRegistry(db, FileStore(tmp_path / "blobs"), cfg, "tiny", LIMITS)
        tenant = registry.tenancy.create_tenant("acme").id
        info = registry.register(tenant, "copy", {f: dirs["emb-trained-base"] / f for f in FILES})
        registry.register(tenant, "plain", {f: write_peft_adapter(tmp_path / "plain", cfg, 4, ["q_proj"], seed=1) / f
                                            for f in FILES})
        assert "embed_tokens (saved base copy)" in info.summary["heads"]
        registry.store = None  # anything that tried to load a blob now would fail loudly
        components = [Component("plain", 0.5), Component("copy", 0.5)]
        with pytest.raises(ApiError) as refused:
            asyncio.run(resolve_components(registry, SimpleNamespace(tenant_id=tenant), components, 64, 64, "tiny"))
        assert refused.value.status == 400 and "'copy' cannot be combined" in str(refused.value)
    finally:
        db.dispose()
    # The summary alone is what refuses: a copy counted in `heads` refuses a version even without an embedding LoRA.
    counted = SimpleNamespace(summary={"dora": False, "embedding": None, "heads": ["embed_tokens (saved base copy)"]})
    assert composition_choice._summary_refusal(counted) is not None
