"""Adapters that change the embedding or the output head, against PEFT 0.21 itself: LoRA on embed_tokens,
modules_to_save of lm_head / embed_tokens, trainable_token_indices (list and per-module), on tiny Llamas with
tied and untied embeddings (ensure_weight_tying too): greedy output equal to PEFT token for token, each
alone and all in one mixed batch with a plain adapter and the base model, prefix caching and prompt-lookup
speculation on. Also: the stored form (registry round trip), device bytes, and refusals by name."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import run_to_completion
from loramux.adapters.formats.heads import EMBED, HEAD, TIED_LORA
from loramux.adapters.formats.peft import load_adapter_dir
from loramux.adapters.formats.validation import AdapterValidationError, UploadLimits, validate_adapter_files
from loramux.engine.config import EngineConfig
from loramux.engine.engine import LLMEngine
from loramux.engine.sampling.params import SamplingParams
from loramux.model.loader import build_model, end_of_turn_ids
from loramux.testing import save_tiny_hf_model, write_peft_adapter

NEW_TOKENS = 8
G = torch.Generator().manual_seed(11)
SHARED = torch.randint(100, 40000, (12,), generator=G).tolist()
TAILS = [torch.randint(100, 40000, (6,), generator=G).tolist() for _ in range(3)]
# Two prompts share a 12-token prefix (three 4-token blocks: the prefix cache) and each repeats an n-gram
# (prompt lookup drafts from it).
PROMPTS = [SHARED + TAILS[0] + SHARED[:5] + TAILS[0], SHARED + TAILS[1] + TAILS[1],
           TAILS[2] + SHARED + TAILS[2] + SHARED[:4]]
TOKENS = [SHARED[0], SHARED[3], TAILS[0][1], TAILS[1][2], TAILS[2][0], 7]  # trainable token ids (in the prompts)

# name: (LoraConfig keyword arguments, model ties embeddings: None = both)
ADAPTERS = {
    "emb-lora": (dict(target_modules=["q_proj", "v_proj", "embed_tokens"]), None),
    "head": (dict(target_modules=["q_proj"], modules_to_save=["lm_head"]), None),
    "emb-full": (dict(target_modules=["v_proj"], modules_to_save=["embed_tokens"]), None),
    "tokens": (dict(target_modules=["q_proj"], trainable_token_indices=TOKENS), None),
    "tokens-dict": (dict(target_modules=["q_proj"], trainable_token_indices={"embed_tokens": TOKENS[:3],
                                                                            "lm_head": TOKENS[2:]}), None),
    "head-tied": (dict(target_modules=["q_proj"], modules_to_save=["lm_head"], ensure_weight_tying=True), True),
    "emb-lora-tied": (dict(target_modules=["q_proj", "embed_tokens"], ensure_weight_tying=True), True),
}


def adapters_for(tied: bool) -> list[str]:
    return [name for name, (_, ties) in ADAPTERS.items() if ties in (None, tied)]


def train_like(model, seed: int) -> None:
    """Give the trained copies PEFT made (modules_to_save, trainable token rows) non-trivial values, as
    training would: PEFT starts them equal to the base weights."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "modules_to_save" in name or "trainable_tokens_delta" in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.5)


def peft_greedy(model_dir, adapter_dir, prompts) -> list[list[int]]:
    """PEFT's greedy tokens for each prompt, from a fresh base model (None: the base model)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    base.generation_config.eos_token_id = None  # exactly NEW_TOKENS tokens, as ignore_eos does here
    base.generation_config.pad_token_id = 0
    model = base if adapter_dir is None else PeftModel.from_pretrained(base, adapter_dir).eval()
    outputs = []
    for ids in prompts:
        with torch.inference_mode():
            out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
        outputs.append(out[0, len(ids):].tolist())
    return outputs


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def heads_world(request, tmp_path_factory, tokenizer):
    """(tied, model dir, {adapter name: dir}, {(prompt index, adapter or None): PEFT's tokens})."""
    import warnings

    from peft import LoraConfig, get_peft_model

    tied = request.param
    root = tmp_path_factory.mktemp(f"heads-{'tied' if tied else 'untied'}")
    model_dir = root / "model"
    save_tiny_hf_model(model_dir, len(tokenizer), weight_scale=4.0, tokenizer=tokenizer, tie_word_embeddings=tied)
    dirs = {}
    for i, name in enumerate(adapters_for(tied)):
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        torch.manual_seed(100 + i)
        with warnings.catch_warnings():  # PEFT warns about tied layers in an adapter: that is the point here
            warnings.simplefilter("ignore")
            peft = get_peft_model(hf, LoraConfig(r=8, lora_alpha=16, init_lora_weights=False, **ADAPTERS[name][0]))
            train_like(peft, 200 + i)
            peft.save_pretrained(root / name)
        dirs[name] = root / name
    from loramux.model.loader import read_model_config

    cfg, _ = read_model_config(model_dir)
    dirs["plain"] = write_peft_adapter(root / "plain", cfg, 8, ["q_proj", "v_proj", "down_proj"], seed=5, b_std=0.5)
    expected = {}
    for name in [None, *dirs]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for index, tokens in enumerate(peft_greedy(model_dir, dirs.get(name), PROMPTS)):
                expected[(index, name)] = tokens
    return tied, model_dir, dirs, expected


def make_engine(model_dir, tokenizer, **overrides) -> LLMEngine:
    model, cfg = build_model(model_dir, torch.float32, torch.device("cpu"))
    config = EngineConfig(**{"block_size": 4, "num_blocks": 512, "max_num_seqs": 32, "max_num_batched_tokens": 64,
                             "max_model_len": 256, "prefix_caching": True, "speculative_tokens": 4,
                             "speculative_max_batch": 32, "async_adapter_loads": False, "max_lora_rank": 16,
                             "adapter_pool_bytes": 1 << 30, **overrides})
    return LLMEngine(model, tokenizer, config, end_of_turn_ids(tokenizer, cfg, model_dir))


def run_all(engine: LLMEngine, requests: dict) -> dict[str, list[int]]:
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = run_to_completion(engine, [(ids, params, adapter) for ids, adapter in requests.values()])
    return {rid: out.token_ids for rid, out in zip(requests, outs)}


def test_each_adapter_changes_what_peft_says(heads_world, tokenizer):
    """What each file holds is read as PEFT means it: the kinds of change, and ties on a tied model."""
    tied, model_dir, dirs, expected = heads_world
    from loramux.model.loader import read_model_config

    cfg, _ = read_model_config(model_dir)
    loaded = {name: load_adapter_dir(path, cfg) for name, path in dirs.items()}
    assert loaded["emb-lora"].embedding[0].shape == (8, cfg.vocab_size) and not loaded["emb-lora"].heads.keys() - {
        f"{EMBED}.base"}
    assert set(loaded["head"].heads) == {HEAD} and set(loaded["emb-full"].heads) == {EMBED}
    tokens = loaded["tokens"].heads
    assert tokens[f"{EMBED}.token_indices"].tolist() == TOKENS
    # A list of token ids trains the embedding rows; on a tied model PEFT ties the head's rows to them.
    assert (f"{HEAD}.token_rows" in tokens) == tied
    if tied:
        assert tokens[f"{HEAD}.token_rows"] is tokens[f"{EMBED}.token_rows"]
        assert loaded["head-tied"].heads[HEAD] is loaded["head-tied"].heads[EMBED]  # ensure_weight_tying
        assert TIED_LORA in loaded["emb-lora-tied"].heads
    by_module = loaded["tokens-dict"].heads
    assert by_module[f"{HEAD}.token_indices"].tolist() == TOKENS[2:]  # different indices: never tied
    for name in dirs:  # every adapter changes some output, so equality below proves something
        assert any(expected[(i, name)] != expected[(i, None)] for i in range(len(PROMPTS))), name


def test_greedy_equals_peft_alone_and_in_one_mixed_batch(heads_world, tokenizer):
    tied, model_dir, dirs, expected = heads_world
    engine = make_engine(model_dir, tokenizer)
    for name, path in dirs.items():
        engine.load_adapter_dir(path, name)
    for name in [None, *dirs]:  # each alone
        got = run_all(engine, {f"{i}": (ids, name) for i, ids in enumerate(PROMPTS)})
        assert got == {f"{i}": expected[(i, name)] for i in range(len(PROMPTS))}, name
    # Everything in one batch: every adapter, the plain one and the base model, each prompt.
    mixed = {f"{i}/{name}": (ids, name) for i, ids in enumerate(PROMPTS) for name in [None, *dirs]}
    got = run_all(engine, mixed)
    assert got == {f"{i}/{name}": expected[(i, name)] for i, _ in enumerate(PROMPTS) for name in [None, *dirs]}
    stats = engine.stats()
    assert stats["prefix_cache_hit_blocks"] > 0 and stats["spec_proposed_tokens"] > 0
    assert stats["kv_blocks_used"] == 0 and stats["adapter_slots_pinned"] == 0


def test_heads_take_their_bytes_in_the_pool(heads_world, tokenizer):
    """Each slot's extras are counted exactly in slot_bytes; PEFT's copy of the unchanged base embedding
    costs nothing on the device."""
    tied, model_dir, dirs, _ = heads_world
    engine = make_engine(model_dir, tokenizer)
    pool = engine.pool
    cfg = engine.model.config
    v, h = cfg.vocab_size, cfg.hidden_size
    for name in ("emb-lora", "head", "tokens"):
        adapter = engine.load_adapter_dir(dirs[name], name)
        run_all(engine, {"r": (PROMPTS[0], name)})
        key = pool.bucket_of(adapter)
        bucket = pool.buckets[key]
        held = sum(t.numel() * t.element_size() for w in bucket.weights.values() for t in (w.a, *w.b)) + \
            sum(t.numel() * t.element_size() for t in bucket.extras.values())
        assert held == bucket.capacity * pool.slot_bytes(key), name
    plain = engine.pool.slot_bytes(engine.pool.bucket_of(load_adapter_dir(dirs["plain"], cfg)))
    head_key = pool.bucket_of(engine.adapters.lookup("head"))
    assert pool.slot_bytes(head_key) == pool.slot_bytes(head_key._replace(extras=())) + v * h * 4
    emb = engine.adapters.lookup("emb-lora")
    assert f"{EMBED}.base" not in emb.heads and EMBED not in emb.heads  # equal to the base: dropped
    assert pool.bucket_of(emb).extras == (("embed_lora", 8),)
    assert plain > 0


def test_registry_round_trip_serves_like_the_directory(heads_world, tokenizer, tmp_path):
    """Uploaded through the registry (pack), read back from the store (unpack): the same tensors, ties
    included, and the same tokens as PEFT."""
    from loramux.adapters.storage.blob import unpack
    from loramux.adapters.storage.registry import AdapterRegistry
    from loramux.adapters.storage.store import FileStore
    from loramux.db import Database
    from loramux.model.loader import read_model_config

    tied, model_dir, dirs, expected = heads_world
    cfg, _ = read_model_config(model_dir)
    db = Database(f"sqlite:///{tmp_path / 'registry.db'}")
    db.upgrade()
    store = FileStore(tmp_path / "blobs")
    registry = AdapterRegistry(db, store, cfg, "tiny", UploadLimits(max_total_bytes=1 << 30, max_rank=16))
    tenant = registry.tenancy.create_tenant("acme").id
    engine = make_engine(model_dir, tokenizer)
    names = adapters_for(tied)
    for name in names:
        files = {f: dirs[name] / f for f in ("adapter_config.json", "adapter_model.safetensors")}
        info = registry.register(tenant, name, files)
        stored = unpack(store.get(info.storage_key), name, info.digest)
        local = load_adapter_dir(dirs[name], cfg)
        assert stored.heads.keys() == local.heads.keys(), name
        for key, tensor in local.heads.items():
            assert torch.equal(stored.heads[key], tensor), (name, key)
        assert (HEAD in stored.heads and stored.heads[HEAD] is stored.heads.get(EMBED)) == \
            (HEAD in local.heads and local.heads[HEAD] is local.heads.get(EMBED)), name
        assert (stored.embedding is None) == (local.embedding is None)
        if local.embedding is not None:
            assert all(torch.equal(a, b) for a, b in zip(stored.embedding, local.embedding))
        engine.register_adapter(stored)
    got = run_all(engine, {f"{i}/{n}": (ids, n) for i, ids in enumerate(PROMPTS) for n in names})
    assert got == {f"{i}/{n}": expected[(i, n)] for i in range(len(PROMPTS)) for n in names}
    db.dispose()


# ------------------------------------------------------------------------------------------- refusals

@pytest.fixture(scope="module")
def head_files(heads_world):
    """The untied-or-tied world's `head` adapter files as bytes, to be tampered with."""
    _, model_dir, dirs, _ = heads_world
    from loramux.model.loader import read_model_config

    cfg, _ = read_model_config(model_dir)
    return cfg, {f: (dirs["head"] / f).read_bytes() for f in ("adapter_config.json", "adapter_model.safetensors")}


def tampered(files: dict, config=None, tensors=None) -> dict:
    from safetensors.torch import load, save

    out = dict(files)
    if config is not None:
        out["adapter_config.json"] = json.dumps({**json.loads(files["adapter_config.json"]), **config}).encode()
    if tensors is not None:
        current = load(files["adapter_model.safetensors"])
        out["adapter_model.safetensors"] = save(tensors(current))
    return out


def refused(files: dict, cfg, limits: UploadLimits | None = None) -> AdapterValidationError:
    with pytest.raises(AdapterValidationError) as info:
        validate_adapter_files(files, cfg, limits or UploadLimits(max_total_bytes=1 << 30))
    return info.value


def test_an_unknown_tensor_is_refused_by_name(head_files):
    cfg, files = head_files
    err = refused(tampered(files, tensors=lambda t: {**t, "base_model.model.model.norm.lora_A.weight":
                                                     torch.zeros(8, cfg.hidden_size)}), cfg)
    assert err.code == "unknown_tensor" and "model.norm.lora_A" in str(err)
    # A head tensor the config does not ask for is unknown too (never silently ignored).
    err = refused(tampered(files, config={"modules_to_save": None}), cfg)
    assert err.code == "unknown_tensor" and "lm_head" in str(err) and "modules_to_save" in str(err)


def test_added_tokens_are_refused_with_what_to_do(head_files):
    cfg, files = head_files
    grown = tampered(files, tensors=lambda t: {k: torch.cat([v, v[:8]]) if "lm_head" in k else v
                                               for k, v in t.items()})
    err = refused(grown, cfg)
    assert err.code == "vocab_mismatch" and str(cfg.vocab_size) in str(err)
    assert "trainable_token_indices" in str(err) and "resize_token_embeddings" in str(err)
    err = refused(tampered(files, config={"modules_to_save": None, "trainable_token_indices": [cfg.vocab_size + 3]},
                           tensors=lambda t: {k: v for k, v in t.items() if "lm_head" not in k}), cfg)
    assert err.code == "vocab_mismatch" and str(cfg.vocab_size + 3) in str(err)


def test_heads_over_the_limit_are_refused_naming_it(head_files):
    cfg, files = head_files
    err = refused(files, cfg, UploadLimits(max_total_bytes=1 << 30, max_head_bytes=1 << 20))
    assert err.code == "head_too_large" and "LORAMUX_MAX_ADAPTER_HEAD_BYTES" in str(err) and str(1 << 20) in str(err)
    validate_adapter_files(files, cfg, UploadLimits(max_total_bytes=1 << 30, max_head_bytes=cfg.vocab_size *
                                                    cfg.hidden_size * 4))


@pytest.mark.parametrize("config, code, words", [
    ({"target_modules": ["q_proj", "lm_head"]}, "unsupported_target", "lm_head"),
    ({"target_modules": r"(.*\.)?(q_proj|lm_head)"}, "unsupported_target", "lm_head"),
    ({"modules_to_save": ["score"]}, "unsupported_option", "score"),
    ({"modules_to_save": "lm_head"}, "bad_option", "list"),
    ({"modules_to_save": ["lm_head"], "trainable_token_indices": {"lm_head": [1, 2]}}, "bad_option", "both"),
    ({"modules_to_save": None, "trainable_token_indices": [4, 4]}, "bad_option", "twice"),
    ({"modules_to_save": None, "trainable_token_indices": "all"}, "bad_option", "trainable_token_indices"),
    ({"modules_to_save": ["lm_head", "embed_tokens"]}, "missing_tensor", "embed_tokens"),
    ({"ensure_weight_tying": "yes"}, "bad_option", "ensure_weight_tying"),
])
def test_head_options_are_checked(head_files, config, code, words):
    cfg, files = head_files
    err = refused(tampered(files, config=config), cfg)
    assert err.code == code and words in str(err), (err.code, str(err))


def test_a_duplicated_head_tensor_is_refused(head_files):
    cfg, files = head_files
    err = refused(tampered(files, tensors=lambda t: {**t, **{k.replace(".weight", ".default.weight"): v.clone()
                                                             for k, v in t.items() if "lm_head" in k}}), cfg)
    assert err.code == "duplicate_tensor"


# ------------------------------------------------------------------------------------------- SmolLM2

@pytest.mark.real_model
def test_smollm2_heads_equal_peft_in_one_mixed_batch(smol_dir, tokenizer, tmp_path):
    """The embedded model (tied embeddings): a trained lm_head, trainable tokens and an embed_tokens LoRA next
    to a plain adapter and the base model, alone and in one batch, equal to PEFT token for token."""
    import warnings

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from loramux.model.loader import read_model_config

    cfg, _ = read_model_config(smol_dir)
    engine = make_engine(smol_dir, tokenizer, max_num_batched_tokens=256, max_model_len=512, adapter_pool_bytes=2 << 30)
    prompts = [engine.encode_chat([{"role": "user", "content": q}])
               for q in ("What is the capital of France?", "Name three colours. Name three colours.")]
    tokens = sorted({prompts[0][-8], prompts[0][-9], prompts[1][-10], prompts[1][-12]})
    configs = {"head": dict(target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"]),
               "tokens": dict(target_modules=["q_proj"], trainable_token_indices=tokens),
               "emb-lora": dict(target_modules=["embed_tokens", "v_proj"])}
    dirs = {}
    for i, (name, kwargs) in enumerate(configs.items()):
        hf = AutoModelForCausalLM.from_pretrained(smol_dir, dtype=torch.float32)
        torch.manual_seed(300 + i)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            peft = get_peft_model(hf, LoraConfig(r=8, lora_alpha=16, init_lora_weights=False, **kwargs))
            g = torch.Generator().manual_seed(400 + i)
            with torch.no_grad():  # as trained: the copies moved away from the base, the embedding LoRA small
                for pname, param in peft.named_parameters():
                    if "modules_to_save" in pname or "trainable_tokens_delta" in pname:
                        param.add_(torch.randn(param.shape, generator=g) * 0.05)
                    elif "lora_embedding_B" in pname:
                        param.mul_(0.01)
            peft.save_pretrained(tmp_path / name)
        dirs[name] = tmp_path / name
    dirs["plain"] = write_peft_adapter(tmp_path / "plain", cfg, 8, ["q_proj", "v_proj"], seed=9)
    expected = {}
    for name in [None, *dirs]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for index, out in enumerate(peft_greedy(smol_dir, dirs.get(name), prompts)):
                expected[(index, name)] = out
    for name in configs:
        assert any(expected[(i, name)] != expected[(i, None)] for i in range(len(prompts))), name
    for name, path in dirs.items():
        engine.load_adapter_dir(path, name)
    for name in [None, *dirs]:
        got = run_all(engine, {f"{i}": (ids, name) for i, ids in enumerate(prompts)})
        assert got == {f"{i}": expected[(i, name)] for i in range(len(prompts))}, name
    mixed = {f"{i}/{name}": (ids, name) for i, ids in enumerate(prompts) for name in [None, *dirs]}
    assert run_all(engine, mixed) == {f"{i}/{n}": expected[(i, n)] for i in range(len(prompts)) for n in [None, *dirs]}
    stats = engine.stats()
    assert stats["prefix_cache_hit_blocks"] > 0 and stats["kv_blocks_used"] == 0


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text"])
def test_scaled_embeddings_and_softcap_follow_peft(family, tokenizer, tmp_path):
    """Gemma scales embeddings by sqrt(hidden) inside the embedding module: PEFT scales the LoRA delta and
    the replaced rows as well; Gemma 2 soft-caps logits after a replacement head as after the base one."""
    import warnings

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    overrides = {"gemma2": {"head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 8,
                            "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0},
                 "gemma3_text": {"head_dim": 16, "num_hidden_layers": 3, "sliding_window": 8,
                                 "layer_types": ["sliding_attention", "sliding_attention", "full_attention"]}}[family]
    model_dir = tmp_path / "model"
    save_tiny_hf_model(model_dir, len(tokenizer), family, weight_scale=4.0, tokenizer=tokenizer,
                       tie_word_embeddings=True, **overrides)
    configs = {"emb-lora": dict(target_modules=["q_proj", "embed_tokens"]),
               "tokens": dict(target_modules=["v_proj"], trainable_token_indices=TOKENS),
               "head": dict(target_modules=["q_proj"], modules_to_save=["lm_head"])}
    dirs = {}
    for i, (name, kwargs) in enumerate(configs.items()):
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        torch.manual_seed(500 + i)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            peft = get_peft_model(hf, LoraConfig(r=8, lora_alpha=16, init_lora_weights=False, **kwargs))
            train_like(peft, 600 + i)
            peft.save_pretrained(tmp_path / name)
        dirs[name] = tmp_path / name
    expected = {}
    for name in [None, *dirs]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for index, out in enumerate(peft_greedy(model_dir, dirs.get(name), PROMPTS)):
                expected[(index, name)] = out
    for name in dirs:
        assert any(expected[(i, name)] != expected[(i, None)] for i in range(len(PROMPTS))), name
    engine = make_engine(model_dir, tokenizer)
    for name, path in dirs.items():
        engine.load_adapter_dir(path, name)
    mixed = {f"{i}/{name}": (ids, name) for i, ids in enumerate(PROMPTS) for name in [None, *dirs]}
    assert run_all(engine, mixed) == {f"{i}/{n}": expected[(i, n)] for i in range(len(PROMPTS)) for n in [None, *dirs]}


def test_heads_next_to_triton_lora_kernels(heads_world, tokenizer):
    """With the Triton LoRA kernels for the projections (TRITON_INTERPRET=1 on CPU), rows whose adapters carry
    an embedding LoRA or a trained head still equal PEFT in one mixed batch: those parts are torch ops on any
    device (loramux.kernels.head_ops), beside whichever projection kernels run."""
    tied, model_dir, dirs, expected = heads_world
    engine = make_engine(model_dir, tokenizer, lora_impl="triton")
    names = ["emb-lora", "head", "tokens", "plain"]
    for name in names:
        engine.load_adapter_dir(dirs[name], name)
    assert engine.pool.wrapper.impl == "triton"
    mixed = {f"{i}/{name}": (ids, name) for i, ids in enumerate(PROMPTS[:2]) for name in [None, *names]}
    assert run_all(engine, mixed) == {f"{i}/{n}": expected[(i, n)] for i in range(2) for n in [None, *names]}


def test_plan_counts_a_trained_head(tiny_cfg):
    from loramux.plan import plan_memory

    plan = plan_memory(tiny_cfg, 2, context_len=128, batch_size=2, adapter_pool=1 << 30, adapter_rank=8)
    assert plan.head_bytes == tiny_cfg.vocab_size * tiny_cfg.hidden_size * 2
