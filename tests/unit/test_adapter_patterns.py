"""Per-module ranks and alphas (rank_pattern / alpha_pattern) and layer subsets (layers_to_transform,
layers_pattern, regex and dotted target_modules, exclude_modules), against PEFT itself: adapters made by
PEFT (get_peft_model + save_pretrained), greedy output equal to PEFT token for token alone and in one mixed
batch with plain adapters and the base model, prefix caching and prompt-lookup speculation on; each module
held and computed at its own rank and scale (costs by shape, exact slot bytes); PEFT's own matching rules
(compared with PEFT's functions); the registry's stored form serving identically; the upload summary."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import decode_step_lora_cost, drafts_expected, run_to_completion
from loramux.adapters.formats.module_selection import module_rank_alpha, select_modules
from loramux.adapters.formats.peft import load_adapter_dir
from loramux.adapters.formats.summary import describe
from loramux.adapters.formats.validation import AdapterValidationError, module_names, validate_adapter_files
from loramux.adapters.storage.blob import pack, unpack
from loramux.engine.config import EngineConfig
from loramux.engine.engine import LLMEngine
from loramux.engine.sampling.params import SamplingParams
from loramux.model.config import ModelConfig
from loramux.model.loader import build_model, end_of_turn_ids
from loramux.testing import save_tiny_hf_model

LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
NEW_TOKENS = 10
PATTERNS = dict(r=8, lora_alpha=16, target_modules=LLAMA_TARGETS,
                rank_pattern={"q_proj": 4, "k_proj": 6, "model.layers.1.mlp.down_proj": 2, "no_such_module": 3},
                alpha_pattern={"v_proj": 3, "layers.0.self_attn.o_proj": 40})
ADAPTERS = {  # name: PEFT LoraConfig arguments
    "patterns": PATTERNS,
    "patterns-twin": PATTERNS,  # same layout, other weights: two slots of one bucket
    "layers": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], layers_to_transform=[0, 2]),
    "layers-pattern": dict(r=8, lora_alpha=8, target_modules=["gate_proj", "up_proj"], layers_to_transform=1,
                           layers_pattern="layers"),
    "regex-subset": dict(r=4, lora_alpha=16,
                         target_modules=r"model\.layers\.(0|2)\.self_attn\.(q|k)_proj|model\.layers\.1\.mlp\.up_proj"),
    "rslora-patterns": dict(r=8, lora_alpha=8, use_rslora=True, target_modules="all-linear",
                            rank_pattern={"o_proj": 2, "gate_proj": 16}, alpha_pattern={"gate_proj": 7},
                            exclude_modules=["layers.2.mlp.down_proj"]),
    "dotted-names": dict(r=4, lora_alpha=4, target_modules=["layers.1.self_attn.v_proj", "o_proj"],
                         alpha_pattern={"layers.2.self_attn.o_proj": 1}),
    "plain-qv": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "plain-all": dict(r=4, lora_alpha=8, target_modules=LLAMA_TARGETS),
}
PATTERNED = [name for name in ADAPTERS if not name.startswith("plain")]


def prompts() -> list[list[int]]:
    """Three prompts: two share a 12-token prefix (three blocks of 4, for the prefix cache) and each repeats
    an n-gram (for prompt lookup to draft from)."""
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(100, 40000, (12,), generator=g).tolist()
    tails = [torch.randint(100, 40000, (6,), generator=g).tolist() for _ in range(3)]
    return [shared + tails[0] + shared[:5] + tails[0], shared + tails[1] + tails[1],
            tails[2] + shared + tails[2] + shared[:4]]


def peft_greedy(model_dir, adapter_dir, prompt_list) -> list[list[int]]:
    """PEFT's greedy tokens (exactly NEW_TOKENS, EOS off as ignore_eos does), adapter None = the base model."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    base.generation_config.eos_token_id = None
    base.generation_config.pad_token_id = 0
    model = base if adapter_dir is None else PeftModel.from_pretrained(base, adapter_dir).eval()
    outputs = []
    for ids in prompt_list:
        with torch.inference_mode():
            out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
        outputs.append(out[0, len(ids):].tolist())
    return outputs


@pytest.fixture(scope="module")
def tiny3(tmp_path_factory, tokenizer):
    """(model dir, ModelConfig): a 3-layer random Llama with the SmolLM2 vocabulary."""
    path = tmp_path_factory.mktemp("tiny3")
    save_tiny_hf_model(path, len(tokenizer), "llama", weight_scale=4.0, tokenizer=tokenizer, num_hidden_layers=3)
    return path, ModelConfig.from_hf(json.loads((path / "config.json").read_text()))


def make_peft_adapter(model_dir, out_dir, seed: int, b_scale: float = 1.0, **lora_kwargs):
    """A PEFT adapter with random A and B (B times `b_scale`), saved by PEFT's save_pretrained."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    model = get_peft_model(hf, LoraConfig(init_lora_weights=False, **lora_kwargs))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(b_scale)
    model.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def adapters(tiny3, tmp_path_factory):
    """name -> PEFT adapter directory, and {(name | None): PEFT greedy outputs per prompt}."""
    model_dir, _ = tiny3
    root = tmp_path_factory.mktemp("pattern-adapters")
    dirs = {name: make_peft_adapter(model_dir, root / name, seed=i, **kwargs)
            for i, (name, kwargs) in enumerate(ADAPTERS.items())}
    expected = {name: peft_greedy(model_dir, path, prompts()) for name, path in dirs.items()}
    expected[None] = peft_greedy(model_dir, None, prompts())
    return dirs, expected


def make_engine(model_dir, tokenizer, **overrides) -> LLMEngine:
    model, cfg = build_model(model_dir, torch.float32, torch.device("cpu"))
    config = EngineConfig(**{"block_size": 4, "num_blocks": 512, "max_num_seqs": 32, "max_num_batched_tokens": 96,
                             "max_model_len": 256, "prefix_caching": True, "speculative_tokens": 4,
                             "speculative_max_batch": 32, "async_adapter_loads": False, "max_lora_rank": 16,
                             "adapter_min_residency_s": 0.0, **overrides})
    return LLMEngine(model, tokenizer, config, end_of_turn_ids(tokenizer, cfg, model_dir))


def run_all(engine: LLMEngine, requests: dict[str, tuple[list[int], str | None]]) -> dict[str, list[int]]:
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = run_to_completion(engine, [(ids, params, adapter) for ids, adapter in requests.values()])
    return {rid: out.token_ids for rid, out in zip(requests, outs)}


# ------------------------------------------------------------------------------------------ equal to PEFT

def test_each_adapter_alone_and_all_mixed_equal_peft(tiny3, tokenizer, adapters):
    model_dir, _ = tiny3
    dirs, expected = adapters
    for name in ADAPTERS:  # every adapter changes the output: equality would prove little otherwise
        assert any(expected[name][i] != expected[None][i] for i in range(3)), name
    engine = make_engine(model_dir, tokenizer)
    for name, path in dirs.items():
        engine.load_adapter_dir(path, name)
    for name in [None, *ADAPTERS]:
        for i, ids in enumerate(prompts()):
            assert run_all(engine, {"r": (ids, name)})["r"] == expected[name][i], (name, i)
    mixed = {f"{i}/{name}": (ids, name) for i, ids in enumerate(prompts()) for name in [None, *ADAPTERS]}
    got = run_all(engine, mixed)
    assert got == {rid: expected[name][int(rid.split("/")[0])] for rid, (_, name) in mixed.items()}
    stats = engine.stats()
    assert stats["prefix_cache_hit_blocks"] > 0
    if any(drafts_expected(ids, expected[n][i]) for i, ids in enumerate(prompts()) for n in [None, *ADAPTERS]):
        assert stats["spec_proposed_tokens"] > 0
    assert stats["kv_blocks_used"] == 0 and stats["adapter_slots_pinned"] == 0
    # The twins share one patterned bucket (two slots); the plain adapters keep plain keys.
    keys = {name: engine.pool.bucket_of(engine.adapters.lookup(name)) for name in ADAPTERS}
    assert keys["patterns"] == keys["patterns-twin"] and engine.pool.capacity(keys["patterns"]) >= 2
    assert all(keys[name].layer_ranks == () and len(keys[name]) == 6 for name in ("plain-qv", "plain-all"))
    assert all(keys[name].layer_ranks for name in PATTERNED)


def test_modules_keep_their_own_rank_and_scale(tiny3, adapters):
    _, cfg = tiny3
    dirs, _ = adapters
    a = load_adapter_dir(dirs["patterns"], cfg)
    ranks = {key: w[0].shape[0] for key, w in a.weights.items()}
    assert ranks[(0, "q_proj")] == 4 and ranks[(2, "k_proj")] == 6 and ranks[(1, "down_proj")] == 2
    assert ranks[(0, "down_proj")] == ranks[(1, "up_proj")] == 8  # no_such_module matched nothing: r stays
    assert a.scale == 2.0 and a.scale_of((0, "q_proj")) == 16 / 4 and a.scale_of((1, "v_proj")) == 3 / 8
    assert a.scale_of((0, "o_proj")) == 40 / 8 and a.scale_of((1, "o_proj")) == 2.0
    assert a.scale_of((1, "down_proj")) == 16 / 2 and (1, "up_proj") not in a.module_scales
    rs = load_adapter_dir(dirs["rslora-patterns"], cfg)
    assert rs.scale_of((0, "gate_proj")) == 7 / 16**0.5 and rs.scale_of((0, "o_proj")) == 8 / 2**0.5
    assert (2, "down_proj") not in rs.weights and (1, "down_proj") in rs.weights  # excluded
    subset = load_adapter_dir(dirs["layers"], cfg)
    assert set(subset.weights) == {(layer, t) for layer in (0, 2) for t in ("q_proj", "v_proj", "down_proj")}
    regex = load_adapter_dir(dirs["regex-subset"], cfg)
    assert set(regex.weights) == {(0, "q_proj"), (0, "k_proj"), (1, "up_proj"), (2, "q_proj"), (2, "k_proj")}
    assert set(load_adapter_dir(dirs["layers-pattern"], cfg).weights) == {(1, "gate_proj"), (1, "up_proj")}


# ------------------------------------------------------------------------------------------ layout and cost

def _own_shape(adapter) -> int:
    """Multiply-adds one row of `adapter` needs: r * (d_in + d_out) over the modules it covers, nothing else."""
    return sum(a.shape[0] * (a.shape[1] + b.shape[0]) for a, b in adapter.weights.values())


def test_each_adapter_costs_its_own_shape_and_slot_bytes_are_exact(tiny3, tokenizer, adapters):
    model_dir, cfg = tiny3
    dirs, _ = adapters
    engine = make_engine(model_dir, tokenizer, speculative_tokens=0, prefix_caching=False)
    loaded = {name: engine.load_adapter_dir(dirs[name], name)
              for name in ("layers", "regex-subset", "patterns", "plain-qv")}
    alone = {name: decode_step_lora_cost(engine, {name: name}, [5, 6, 7, 8, 9]) for name in loaded}
    # A plain q/v adapter computes q, k and v of every layer at its rank (k's zeros included), as before.
    assert alone["plain-qv"][0] == 8 * cfg.num_layers * (3 * cfg.hidden_size + cfg.q_size + 2 * cfg.kv_size)
    for name, adapter in loaded.items():
        if name.startswith("plain"):
            continue
        assert alone[name][0] == _own_shape(adapter), name  # no padded zeros, no uncovered module computed
        key = engine.pool.bucket_of(adapter)
        element = 4  # float32 pool
        scales = sum(sum(1 for r in ranks if r) for _, _, ranks in key.layer_ranks)
        assert engine.pool.slot_bytes(key) == element * sum(a.numel() + b.numel() for a, b in
                                                            adapter.weights.values()) + 4 * scales, name
        assert describe(adapter, cfg, element)["device_bytes"]["lora"] == engine.pool.slot_bytes(key)
    together = decode_step_lora_cost(engine, {name: name for name in loaded}, [5, 6, 7, 8, 9])
    assert together == tuple(sum(alone[n][i] for n in loaded) for i in range(2))
    subset = loaded["layers"]
    assert engine.pool.bucket_of(subset).layer_ranks == tuple(
        (layer, path, ranks) for layer in (0, 2) for path, ranks in
        (("self_attn.qkv_proj", (4, 0, 4)), ("mlp.down_proj", (4,))))


# ------------------------------------------------------------------------------------------ PEFT's rules

SELECTIONS = [
    dict(target_modules=["q_proj", "v_proj"]),
    dict(target_modules=["q_proj", "down_proj"], layers_to_transform=[0, 2]),
    dict(target_modules=["q_proj", "down_proj"], layers_to_transform=1, layers_pattern="layers"),
    dict(target_modules=["q_proj"], layers_to_transform=[1], layers_pattern=["blocks", "layers"]),
    dict(target_modules=["q_proj"], layers_to_transform=[1], layers_pattern="h"),  # matches no layer
    dict(target_modules=["self_attn.k_proj", "layers.2.mlp.up_proj", "model.layers.0.mlp.gate_proj"]),
    dict(target_modules=["model.layers.0.mlp.gate_proj", "o_proj"], layers_to_transform=[1]),
    dict(target_modules=["q_proj", "o_proj"], exclude_modules=["layers.1.self_attn.o_proj"]),
    dict(target_modules=["q_proj", "o_proj"], exclude_modules=r".*\.1\..*"),
    dict(target_modules=r".*\.layers\.[02]\.(self_attn|mlp)\.(q|down)_proj"),
    dict(target_modules="all-linear", exclude_modules=["v_proj"]),
    dict(target_modules=["q_proj"], layers_to_transform=[7]),  # past the last layer: selects nothing
]
RANK_PATTERNS = [
    {"q_proj": 4, "model.layers.0.self_attn.q_proj": 2},  # the first matching key wins, in the config's order
    {"model.layers.0.self_attn.q_proj": 2, "q_proj": 4},
    {"layers.1.mlp.down_proj": 3, "proj": 5, "_proj": 6},  # a key matches a whole dotted suffix only
    {"^model.layers.2.self_attn.v_proj": 7, r"layers\.[01]\..*_proj": 9},
    {"k_proj|v_proj": 11, "nothing_here": 12},
]


@pytest.mark.parametrize("index", range(len(SELECTIONS)))
def test_module_selection_is_pefts(tiny3, index):
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists

    _, cfg = tiny3
    kwargs = SELECTIONS[index]
    names = module_names(cfg)
    peft_config = LoraConfig(r=4, **kwargs)
    if kwargs["target_modules"] == "all-linear":
        peft_config.target_modules = set(names.values())  # as PEFT expands it on a model (no LM head here)
    theirs = [key for key, name in names.items()
              if check_target_module_exists(peft_config, name) and
              type(check_target_module_exists(peft_config, name)).__name__ != "_ExcludedModule"]
    config = {"r": 4, "lora_alpha": 8, **kwargs}
    assert select_modules(config, names) == theirs


@pytest.mark.parametrize("index", range(len(RANK_PATTERNS)))
def test_rank_and_alpha_patterns_resolve_as_pefts_get_pattern_key(tiny3, index):
    from peft.utils.other import get_pattern_key

    _, cfg = tiny3
    pattern = RANK_PATTERNS[index]
    names = module_names(cfg)
    config = {"r": 8, "lora_alpha": 16, "target_modules": LLAMA_TARGETS, "rank_pattern": pattern,
              "alpha_pattern": {k: v * 10 for k, v in pattern.items()}}
    ours = module_rank_alpha(config, names)
    for key, name in names.items():
        r_key = get_pattern_key(pattern.keys(), name)
        assert ours[key] == (pattern.get(r_key, 8), pattern.get(r_key, 1.6) * 10), name


# ------------------------------------------------------------------------------------------ refusals

def _edit(path, tmp_path, config_changes=None, tensors=None):
    """A copy of adapter dir `path` with config keys replaced and tensors(dict) edited in place."""
    import shutil

    from safetensors.torch import load_file, save_file

    out = tmp_path / f"edited-{len(list(tmp_path.iterdir()))}"
    shutil.copytree(path, out)
    config = json.loads((out / "adapter_config.json").read_text())
    config.update(config_changes or {})
    (out / "adapter_config.json").write_text(json.dumps(config))
    if tensors is not None:
        weights = load_file(out / "adapter_model.safetensors")
        tensors(weights)
        save_file(weights, out / "adapter_model.safetensors")
    return out


def test_an_extra_unknown_tensor_is_refused_by_name(tiny3, adapters, tmp_path):
    _, cfg = tiny3
    dirs, _ = adapters
    bad = _edit(dirs["patterns"], tmp_path, tensors=lambda t: t.update({"base_model.model.extra_scale": torch.ones(3)}))
    with pytest.raises(AdapterValidationError, match="unexpected tensor 'base_model.model.extra_scale'") as refused:
        load_adapter_dir(bad, cfg)
    assert refused.value.code == "unknown_tensor"


def test_a_tensor_of_a_module_the_config_does_not_select_is_refused_by_name(tiny3, adapters, tmp_path):
    _, cfg = tiny3
    dirs, _ = adapters
    name = "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"
    extra = {name: torch.zeros(4, cfg.hidden_size),
             name.replace("lora_A", "lora_B"): torch.zeros(cfg.q_size, 4)}
    bad = _edit(dirs["layers"], tmp_path, tensors=lambda t: t.update(extra))
    with pytest.raises(AdapterValidationError, match=f"tensor '{name}' is for layer 1 q_proj, a module") as refused:
        load_adapter_dir(bad, cfg)
    assert refused.value.code == "target_mismatch" and "layers_to_transform [0, 2]" in str(refused.value)


@pytest.mark.parametrize("changes,code,fragment", [
    ({"rank_pattern": {"q_proj": 0}}, "bad_rank", "rank_pattern['q_proj'] must be a positive integer"),
    ({"rank_pattern": {"q_proj": True}}, "bad_rank", "must be a positive integer"),
    ({"rank_pattern": {"q_proj": 64}}, "rank_out_of_range", "rank_pattern['q_proj'] = 64 is above"),
    ({"rank_pattern": ["q_proj", 4]}, "bad_option", "rank_pattern must be an object"),
    ({"alpha_pattern": {"v_proj": -1}}, "bad_alpha", "alpha_pattern['v_proj'] must be a positive number"),
    ({"alpha_pattern": {"(?=v)_proj": 2}}, "bad_option", "is not a supported regular expression"),
    ({"rank_pattern": {"a" * 1001: 2}}, "bad_option", "above the limit of 1000"),
    ({"rank_pattern": {f"k{i}": 2 for i in range(513)}}, "bad_option", "513 entries, above the limit of 512"),
    ({"rank_pattern": {"q_proj": 5}}, "shape_mismatch", "expected (5, 64) for r=5 (rank_pattern) on this base model"),
    ({"layers_to_transform": "0"}, "bad_option", "layers_to_transform must be a layer index"),
    ({"layers_to_transform": [0, -1]}, "bad_option", "layers_to_transform must be a layer index"),
    ({"layers_pattern": "layers", "layers_to_transform": None}, "bad_option", "without layers_to_transform"),
    ({"target_modules": ".*q_proj", "layers_to_transform": [0]}, "bad_option", "cannot be used with a target_modules"),
    ({"layers_to_transform": [0, 2], "layers_pattern": "(?<=x)"}, "bad_option", "not a supported regular"),
    ({"exclude_modules": 7}, "bad_option", "exclude_modules must be a list"),
    ({"layers_to_transform": [0]}, "target_mismatch", "' is for layer 2 "),
    ({"layers_to_transform": [0, 1, 2]}, "missing_tensor", "layer 1 q_proj lacks lora_A"),
])
def test_bad_pattern_and_layer_options_are_refused(tiny3, adapters, tmp_path, changes, code, fragment):
    _, cfg = tiny3
    dirs, _ = adapters
    base = "patterns" if any(k in changes for k in ("rank_pattern", "alpha_pattern")) else "layers"
    bad = _edit(dirs[base], tmp_path, changes)
    with pytest.raises(AdapterValidationError) as refused:
        load_adapter_dir(bad, cfg, max_rank=16)
    assert refused.value.code == code and fragment in str(refused.value), str(refused.value)


# ------------------------------------------------------------------------------------------ stored form

def test_registry_round_trip_serves_identically(tiny3, tokenizer, adapters, tmp_path):
    """Uploaded to the registry (validated, packed into the stored blob, unpacked by the serving path), each
    patterned adapter is the one loaded from its directory and serves PEFT's tokens."""
    from loramux.adapters.storage.registry import AdapterRegistry
    from loramux.adapters.storage.store import FileStore
    from loramux.db import Database

    model_dir, cfg = tiny3
    dirs, expected = adapters
    db = Database(f"sqlite:///{tmp_path / 'registry.db'}")
    db.upgrade()
    registry = AdapterRegistry(db, FileStore(tmp_path / "blobs"), cfg, "tiny3")
    tenant = registry.tenancy.create_tenant("acme")
    engine = make_engine(model_dir, tokenizer)
    for name in ("patterns", "rslora-patterns", "layers", "regex-subset"):
        files = {f: dirs[name] / f for f in ("adapter_config.json", "adapter_model.safetensors")}
        version = registry.register(tenant.id, name, files)
        stored = unpack(registry.store.get(version.storage_key), name, version.digest)
        direct = load_adapter_dir(dirs[name], cfg, name)
        assert stored.module_scales == direct.module_scales
        assert bool(stored.module_scales) == (name in ("patterns", "rslora-patterns"))
        assert sorted(stored.weights) == sorted(direct.weights)
        for key, (a, b) in direct.weights.items():
            assert torch.equal(stored.weights[key][0], a) and torch.equal(stored.weights[key][1], b)
        engine.register_adapter(stored)
        for i, ids in enumerate(prompts()):
            assert run_all(engine, {"r": (ids, name)})["r"] == expected[name][i], (name, i)
    db.dispose()


def test_a_plain_adapters_blob_is_unchanged(tiny3, adapters):
    """No module_scales key for a plain adapter: blobs (and digests) stored before patterns stay the same."""
    _, cfg = tiny3
    dirs, _ = adapters
    files = {f: dirs["plain-all"] / f for f in ("adapter_config.json", "adapter_model.safetensors")}
    valid = validate_adapter_files(files, cfg)
    blob, digest = pack(valid.rank, valid.alpha, valid.use_rslora, valid.target_modules, valid.tensors,
                        module_scales=valid.module_scales)
    assert (blob, digest) == pack(valid.rank, valid.alpha, valid.use_rslora, valid.target_modules, valid.tensors)
    assert b"module_scales" not in blob and unpack(blob, "p").module_scales == {}


# ------------------------------------------------------------------------------------------ summary

def test_summary_says_what_the_adapter_changes(tiny3, adapters):
    _, cfg = tiny3
    dirs, _ = adapters
    a = load_adapter_dir(dirs["patterns"], cfg)
    summary = describe(a, cfg, 2)
    json.dumps(summary)  # JSON-ready
    assert summary["layout"] == "per-module" and summary["rank"] == 8 and summary["scale"] == 2.0
    assert list(summary["modules"]) == LLAMA_TARGETS
    assert summary["modules"]["q_proj"] == {"layers": [0, 1, 2], "rank_min": 4, "rank_max": 4, "scale_min": 4.0,
                                            "scale_max": 4.0}
    assert summary["modules"]["down_proj"] == {"layers": [0, 1, 2], "rank_min": 2, "rank_max": 8,
                                               "scale_min": 2.0, "scale_max": 8.0}
    assert summary["modules"]["o_proj"]["scale_max"] == 5.0
    assert summary["dora"] is False and summary["embedding"] is None and summary["heads"] == []
    weights = sum(x.numel() for pair in a.weights.values() for x in pair)
    scales = sum(1 for _ in a.weights)  # one float32 scale per module (no module shares a slice here)
    assert summary["device_bytes"] == {"lora": 2 * weights + 4 * scales, "dora": 0, "embedding": 0, "heads": 0,
                                       "experts": 0, "total": 2 * weights + 4 * scales}
    subset = describe(load_adapter_dir(dirs["layers"], cfg), cfg, 4)
    assert {t: m["layers"] for t, m in subset["modules"].items()} == {t: [0, 2] for t in ("q_proj", "v_proj",
                                                                                       "down_proj")}
    plain = load_adapter_dir(dirs["plain-qv"], cfg)
    summary = describe(plain, cfg, 4)
    assert summary["layout"] == "plain"
    # A plain q/v adapter holds q, k and v of every layer at its rank (k as zeros): that is what it costs.
    assert summary["device_bytes"]["lora"] == 8 * cfg.num_layers * 4 * (3 * cfg.hidden_size + cfg.q_size +
                                                                        2 * cfg.kv_size)
    # Fields the DoRA / embedding / heads formats fill are read, and their bytes counted.
    plain.magnitudes = {(0, "q_proj"): torch.ones(cfg.q_size)}
    plain.embedding = (torch.zeros(4, cfg.vocab_size), torch.zeros(cfg.hidden_size, 4))
    plain.heads = {"lm_head": torch.zeros(cfg.vocab_size, cfg.hidden_size)}
    summary = describe(plain, cfg, 2)
    assert summary["dora"] is True and summary["embedding"] == {"rank": 4} and summary["heads"] == ["lm_head"]
    parts = summary["device_bytes"]
    # DoRA's scales as the pool holds them: a row of the merged qkv width in every layer of the bucket.
    assert parts["dora"] == 2 * cfg.num_layers * (cfg.q_size + 2 * cfg.kv_size)
    assert parts["heads"] == 2 * cfg.vocab_size * cfg.hidden_size
    assert parts["embedding"] == 2 * 4 * (cfg.vocab_size + cfg.hidden_size) + 4 and parts["total"] == sum(
        v for k, v in parts.items() if k != "total")


# ------------------------------------------------------------------------------------------ Triton

def test_triton_kernels_serve_patterned_adapters_like_the_torch_path(tiny3, tokenizer, adapters):
    """Per-slice ranks and scales through the Triton kernels (interpreted on CPU): PEFT's tokens."""
    pytest.importorskip("triton")
    model_dir, _ = tiny3
    dirs, expected = adapters
    engine = make_engine(model_dir, tokenizer, lora_impl="triton", speculative_tokens=0)
    names = ["patterns", "regex-subset", "plain-qv"]
    for name in names:
        engine.load_adapter_dir(dirs[name], name)
    ids = prompts()[1]
    got = run_all(engine, {f"{name}": (ids, name) for name in [*names, None]})
    assert got == {f"{name}": expected[name][1] for name in [*names, None]}


# ------------------------------------------------------------------------------------------ SmolLM2

@pytest.mark.real_model
def test_smollm2_patterned_adapter_equals_peft_alone_and_mixed(smol_dir, tokenizer, tmp_path):
    from loramux.model.loader import read_model_config

    cfg, _ = read_model_config(smol_dir)
    patterned = make_peft_adapter(smol_dir, tmp_path / "patterned", seed=3, b_scale=0.1, r=8, lora_alpha=16,
                                  target_modules=["q_proj", "v_proj", "o_proj", "down_proj"],
                                  layers_to_transform=list(range(0, cfg.num_layers, 3)),
                                  rank_pattern={"v_proj": 4, "down_proj": 12}, alpha_pattern={"o_proj": 4})
    plain = make_peft_adapter(smol_dir, tmp_path / "plain", seed=4, b_scale=0.1, r=8, lora_alpha=16,
                              target_modules=["q_proj", "v_proj"])
    questions = ["What is the capital of France?", "Name three colours. Name three colours."]
    prompt_ids = []
    for question in questions:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                            tokenize=True)
        prompt_ids.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    expected = {name: peft_greedy(smol_dir, path, prompt_ids)
                for name, path in (("patterned", patterned), ("plain", plain), (None, None))}
    assert expected["patterned"] != expected[None]
    engine = make_engine(smol_dir, tokenizer, num_blocks=400, max_model_len=512)
    engine.load_adapter_dir(patterned, "patterned")
    engine.load_adapter_dir(plain, "plain")
    for i, ids in enumerate(prompt_ids):
        assert run_all(engine, {"r": (ids, "patterned")})["r"] == expected["patterned"][i]
    mixed = {f"{i}/{n}": (ids, n) for i, ids in enumerate(prompt_ids) for n in ("patterned", "plain", None)}
    got = run_all(engine, mixed)
    assert got == {rid: expected[n][int(rid.split("/")[0])] for rid, (_, n) in mixed.items()}
    assert engine.stats()["prefix_cache_hit_blocks"] > 0


# ------------------------------------------------------------------------------------------ kernels

def _per_slice_case(slot_map, seed=0):
    """Stacked slices at ranks 3, 5 and 2 with a scale per slice and slot, and their float64 result."""
    from loramux.kernels.torch_ops import lora_expand_reference, lora_shrink_reference

    g = torch.Generator().manual_seed(seed)
    n_slots, d_in, outs, ranks, offsets = 4, 24, [16, 8, 8], [3, 5, 2], [0, 16, 24]
    x = torch.randn(len(slot_map), d_in, generator=g)
    a = torch.randn(n_slots, sum(ranks), d_in, generator=g)
    bs = [torch.randn(n_slots, r, o, generator=g).transpose(1, 2) for r, o in zip(ranks, outs)]
    scale = torch.rand(len(ranks), n_slots, generator=g) + 0.25
    y = torch.randn(len(slot_map), sum(outs), generator=g)
    sm = torch.tensor(slot_map)
    expected, start = y.double().clone(), 0
    for i, (b, off) in enumerate(zip(bs, offsets)):
        v_i = lora_shrink_reference(x, a[:, start:start + ranks[i]], sm)
        expected = lora_expand_reference(expected, v_i, b, scale[i], sm, off)
        start += ranks[i]
    return y, x, a, bs, offsets, scale, expected


@pytest.mark.parametrize("impl", ["torch-bmm", "torch-grouped", "triton"])
@pytest.mark.parametrize("slot_map", [[0, 1, 2, 3, 1, -1, 2, 0], [3] * 5 + [-1] * 2, [2, -1, 0], [1] * 9 + [0, 3]])
def test_per_slice_ranks_and_scales_match_the_reference(impl, slot_map, monkeypatch):
    """Slice i's A rows right after slice i-1's, each slice its own rank and scale: the torch strategies and
    the Triton kernels (interpreted on CPU) against a float64 per-slice reference."""
    from loramux.kernels import torch_ops
    from loramux.kernels.ops import LoRABatch, LoRACost, lora_shrink_expand

    if impl == "triton":
        pytest.importorskip("triton")
    else:
        monkeypatch.setattr(torch_ops, "pick_strategy", lambda groups: impl.split("-")[1])
    y, x, a, bs, offsets, scale, expected = _per_slice_case(slot_map, len(slot_map))
    cost = LoRACost()
    lora_shrink_expand(y, x, a, bs, offsets, scale, LoRABatch.from_slot_map(slot_map),
                       impl="triton" if impl == "triton" else "torch", cost=cost)
    torch.testing.assert_close(y.double(), expected, atol=1e-4, rtol=1e-4)
    if impl == "triton":  # each row costs its slices' own ranks: (3 + 5 + 2) * 24 + 3*16 + 5*8 + 2*8
        assert cost.macs == sum(1 for s in slot_map if s >= 0) * (10 * 24 + 48 + 40 + 16)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_per_slice_ranks_and_scales_in_fixed_shape_decode(impl):
    """The BGMV ops (captured decode steps) take the same per-slice layout."""
    from loramux.kernels.bgmv import bgmv_shrink_expand

    if impl == "triton":
        pytest.importorskip("triton")
    slot_map = [2, -1, 0, 3, 3]
    y, x, a, bs, offsets, scale, expected = _per_slice_case(slot_map, 11)
    bgmv_shrink_expand(y, x, a, bs, offsets, scale, torch.tensor(slot_map), impl=impl)
    torch.testing.assert_close(y.double(), expected, atol=1e-4, rtol=1e-4)


def test_fused_phi3_patterns_split_onto_the_engines_projections_exactly(tmp_path):
    """Phi-3's fused qkv_proj / gate_up_proj with rank_pattern, alpha_pattern and a layer subset: each
    sub-projection's scale * B @ A is PEFT's delta weight, and layers left out hold nothing."""
    from peft import LoraConfig, get_peft_model

    hf = save_tiny_hf_model(tmp_path / "phi3", 300, "phi3", pad_token_id=0)
    cfg = ModelConfig.from_hf(json.loads((tmp_path / "phi3" / "config.json").read_text()))
    torch.manual_seed(0)
    peft = get_peft_model(hf, LoraConfig(r=8, lora_alpha=16, init_lora_weights=False, layers_to_transform=[1],
                                         target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
                                         rank_pattern={"qkv_proj": 4}, alpha_pattern={"layers.1.mlp.down_proj": 3}))
    peft.save_pretrained(tmp_path / "lora")
    adapter = load_adapter_dir(tmp_path / "lora", cfg)
    assert {layer for layer, _ in adapter.weights} == {1}
    assert adapter.weights[(1, "k_proj")][0].shape[0] == 4 and adapter.scale_of((1, "v_proj")) == 4.0
    assert adapter.scale_of((1, "down_proj")) == 3 / 8 and adapter.scale_of((1, "up_proj")) == 2.0
    parts = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
             "o_proj": ("o_proj",), "down_proj": ("down_proj",)}
    for fused, subs in parts.items():
        section = "self_attn" if fused in ("qkv_proj", "o_proj") else "mlp"
        delta = peft.base_model.model.model.layers[1].get_submodule(f"{section}.{fused}").get_delta_weight("default")
        ours = torch.cat([adapter.scale_of((1, p)) * adapter.weights[(1, p)][1] @ adapter.weights[(1, p)][0]
                          for p in subs])
        torch.testing.assert_close(ours, delta, msg=fused)


def test_the_regex_deadline_counts_cpu_time_so_a_starved_thread_is_not_refused(tiny3, monkeypatch):
    """Wall time jumping 10 s between two names (the thread waiting for a core on a loaded machine) used to
    refuse a harmless pattern as too slow; only this thread's CPU time counts now, and still bounds it."""
    from loramux.adapters.formats import module_selection

    _, cfg = tiny3
    names = module_names(cfg)
    config = {"r": 4, "lora_alpha": 8, "target_modules": r".*\.(q|v)_proj", "rank_pattern": {"q_proj": 2}}
    expected = [key for key in names if key[1] in ("q_proj", "v_proj")]

    def jumping(step: float):
        now = [0.0]

        def clock() -> float:
            now[0] += step
            return now[0]
        return clock

    with monkeypatch.context() as patch:
        patch.setattr(module_selection.time, "monotonic", jumping(10.0))  # the wall clock of a starved machine
        assert select_modules(config, names) == expected
        assert module_rank_alpha(config, names)[expected[0]] == (2, 8)
    monkeypatch.setattr(module_selection, "_cpu_clock", jumping(10.0))  # a pattern that really costs CPU
    with pytest.raises(AdapterValidationError, match="took too long to match"):
        select_modules(config, names)
    with pytest.raises(AdapterValidationError, match="rank_pattern / alpha_pattern took too long"):
        module_rank_alpha(config, names)
