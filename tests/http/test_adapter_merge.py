"""Stored merges of adapters: every method equals PEFT's own `add_weighted_adapter` on a real PeftModel of the
tiny Llama (tensor for tensor, same seed for DARE), the merged adapter served through the admin API generates
what HF + PEFT's merged model generates, its provenance is answered by the API, shown by the console and the
CLI makes one; refusals (unknown or invisible components, method preconditions, DoRA) name what to fix. Bounds:
svd asks for thin matrices, a merge above the memory bound is refused before it starts (413 naming
LORAMUX_MERGE_MEMORY_BYTES), worker merges are stopped by their memory and time limits and leave no process,
temporary file, row or blob."""
from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch

from conftest import admin_client, live_stack, make_engine, new_tenant_key
from loramux.adapters.composition.merge import (
    MergeComponent,
    MergeError,
    MergeLimits,
    MergeTooLarge,
    check_components,
    check_memory,
    check_request,
    merge,
    merge_pool,
    peak_bytes,
)
from loramux.adapters.formats.peft import build_adapter, load_adapter_dir
from loramux.testing import save_tiny_hf_model, write_peft_adapter

ADMIN_KEY = "lmxa-merge-admin-key-0123456789abcdefghijklmnop"
NEW_TOKENS = 8
PROMPTS = [[1, 450, 3200, 17, 99, 23001, 871], [1, 12, 5, 4000, 300, 17, 12, 5]]
# (name, rank, targets, seed, alpha): two of rank 8 on different targets, one of rank 4 (cat, svd only).
SPECS = [("a", 8, ["q_proj", "v_proj"], 1, 16.0), ("b", 8, ["q_proj", "v_proj", "down_proj"], 2, 8.0),
         ("c", 4, ["q_proj", "o_proj"], 3, 12.0)]
# method: (components, weights, parameters)
CASES = {
    "cat": (["a", "c"], [1.0, 0.7], {}),
    "linear": (["a", "b"], [0.6, 0.4], {}),
    "ties": (["a", "b"], [1.0, 0.5], {"density": 0.6, "majority_sign_method": "frequency"}),
    "dare_linear": (["a", "b"], [0.8, 0.5], {"density": 0.7, "seed": 1234}),
    "dare_ties": (["a", "b"], [0.8, -0.5], {"density": 0.5, "seed": 99}),
    "svd": (["a", "b", "c"], [1.0, 0.5, 0.8], {"svd_rank": 6}),
}


@pytest.fixture(scope="module")
def adapters(tiny_dir, tiny_cfg, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("merge-adapters")
    return {name: write_peft_adapter(root / name, tiny_cfg, rank, targets, seed=seed, alpha=alpha, b_std=0.3)
            for name, rank, targets, seed, alpha in SPECS}


def peft_merged(model_dir: Path, dirs: dict[str, Path], names, weights, method, params):
    """PEFT's merge on a real PeftModel of the base: (the model, with the merged adapter active)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model = PeftModel.from_pretrained(base, dirs[names[0]], adapter_name="c0")
    for i, name in enumerate(names[1:], 1):
        model.load_adapter(dirs[name], adapter_name=f"c{i}")
    kwargs = {k: v for k, v in params.items() if k != "seed"}
    if method == "svd":  # as loramux merges: thin U and Vh (PEFT's default, full matrices, is d_out x d_out)
        kwargs.setdefault("svd_full_matrices", False)
    torch.manual_seed(params.get("seed", 0))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the merge worker: BLAS and LAPACK round by how they split the work
    try:
        model.add_weighted_adapter([f"c{i}" for i in range(len(names))], weights, "merged", combination_type=method,
                                   **kwargs)
    finally:
        torch.set_num_threads(threads)
    model.set_adapter("merged")
    return model


def peft_tensors(model) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, float]]:
    out = {}
    for name, module in model.named_modules():
        if hasattr(module, "lora_A") and "merged" in module.lora_A:
            parts = name.split(".")
            key = (int(parts[parts.index("layers") + 1]), parts[-1])
            out[key] = (module.lora_A["merged"].weight.detach(), module.lora_B["merged"].weight.detach(),
                        module.scaling["merged"])
    return out


@pytest.mark.parametrize("method", list(CASES))
def test_each_method_equals_peft_add_weighted_adapter(method, adapters, tiny_dir, tiny_cfg):
    names, weights, params = CASES[method]
    components = [MergeComponent(n, load_adapter_dir(adapters[n], tiny_cfg), w) for n, w in zip(names, weights)]
    checked = check_request(method, params, weights)
    check_components(method, checked, components, tiny_cfg)
    merged = merge(method, checked, components, tiny_cfg)
    # Through the upload's validation, as the registry stores it.
    ours = build_adapter("m", merged.config, merged.weights, tiny_cfg)
    want = peft_tensors(peft_merged(tiny_dir, adapters, names, weights, method, params))
    assert set(ours.weights) == set(want) and want
    for key, (a, b, scale) in want.items():
        torch.testing.assert_close(ours.weights[key][0], a, rtol=0, atol=0)
        torch.testing.assert_close(ours.weights[key][1], b, rtol=0, atol=0)
        assert ours.scale_of(key) == scale
    if method.startswith("dare"):  # reproducible: the same seed gives the same bytes, another seed others
        assert merge(method, checked, components, tiny_cfg).weights == merged.weights
        other = merge(method, {**checked, "seed": checked["seed"] + 1}, components, tiny_cfg)
        assert other.weights != merged.weights


def test_dare_without_a_seed_gets_one_to_record():
    params = check_request("dare_ties", {"density": 0.5}, [1.0, 1.0])
    assert isinstance(params["seed"], int) and params["majority_sign_method"] == "total"
    assert "seed" not in check_request("ties", {"density": 0.5}, [1.0, 1.0])


@pytest.mark.parametrize("method, params, weights, param, words", [
    ("mean", {}, [1, 1], "method", "method must be one of cat, linear"),
    ("cat", {"density": 0.5}, [1, 1], "parameters.density", "does not apply to method cat"),
    ("ties", {}, [1, 1], "parameters.density", "needs parameters.density in (0, 1]"),
    ("dare_ties", {"density": 0}, [1, 1], "parameters.density", "got 0"),
    ("dare_linear", {"density": 1.5}, [1, 1], "parameters.density", "(0, 1]"),
    ("ties", {"density": 0.5, "majority_sign_method": "most"}, [1, 1], "parameters.majority_sign_method",
     "total, frequency"),
    ("svd", {"svd_rank": 0}, [1, 1], "parameters.svd_rank", "positive integer"),
    ("svd", {"svd_clamp": 2}, [1, 1], "parameters.svd_clamp", "quantile"),
    ("dare_linear", {"density": 0.5, "seed": -1}, [1, 1], "parameters.seed", "integer"),
    ("cat", {}, [1], "components", "2 to 16 components"),
    ("cat", {}, [1, float("nan")], "components[1].weight", "finite number"),
])
def test_request_refusals_name_the_parameter(method, params, weights, param, words):
    with pytest.raises(MergeError) as info:
        check_request(method, params, weights)
    assert info.value.param == param and words in str(info.value), str(info.value)
    assert info.value.code == "invalid_merge"


def test_component_preconditions(adapters, tiny_cfg, tmp_path):
    a, b, c = (load_adapter_dir(adapters[n], tiny_cfg) for n in "abc")
    with pytest.raises(MergeError, match=r"same rank \(a r=8, c r=4\); use cat or svd"):
        check_components("linear", {}, [MergeComponent("a", a, 1), MergeComponent("c", c, 1)], tiny_cfg)
    with pytest.raises(MergeError, match="rank 64 is larger than the smallest merged projection"):
        check_components("svd", {"svd_rank": 64}, [MergeComponent("a", a, 1), MergeComponent("b", b, 1)], tiny_cfg)
    with pytest.raises(MergeError, match="rank 20, above this server's limit of 16"):
        check_components("cat", {}, [MergeComponent("a", a, 1), MergeComponent("b", b, 1),
                                     MergeComponent("c", c, 1)], tiny_cfg, max_rank=16)
    dora = _peft_dir(tmp_path / "dora", tiny_cfg, use_dora=True)
    with pytest.raises(MergeError, match=r"component d has DoRA \(lora_magnitude_vector\)"):
        check_components("cat", {}, [MergeComponent("a", a, 1), MergeComponent("d", dora, 1)], tiny_cfg)


def _peft_dir(path: Path, cfg, **lora):
    """A small PEFT adapter with options write_peft_adapter does not write (DoRA), loaded."""
    config = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"], **lora}
    from safetensors.torch import save

    g = torch.Generator().manual_seed(5)
    tensors = {}
    for layer in range(cfg.num_layers):
        prefix = f"base_model.model.model.layers.{layer}.self_attn.q_proj"
        tensors[f"{prefix}.lora_A.weight"] = torch.randn(8, cfg.hidden_size, generator=g)
        tensors[f"{prefix}.lora_B.weight"] = torch.randn(cfg.q_size, 8, generator=g)
        if lora.get("use_dora"):
            tensors[f"{prefix}.lora_magnitude_vector"] = torch.rand(cfg.q_size, generator=g) + 0.5
    return build_adapter(path.name, json.dumps(config), save(tensors), cfg)


# ---------------------------------------------------------------------------------------------- over HTTP

@pytest.fixture(scope="module")
def served(tmp_path_factory, tokenizer, adapters):
    """A live server on a tiny Llama with weights large enough that adapters change greedy tokens; tenant acme
    owns a, b, c (uploaded through the API), tenant other a private `secret` and a public `shared`.
    Yields (server, admin client, acme's key, model dir)."""

    root = tmp_path_factory.mktemp("merge-served")
    model_dir = root / "model"
    save_tiny_hf_model(model_dir, len(tokenizer), weight_scale=4.0, tokenizer=tokenizer)
    engine = make_engine(model_dir, tokenizer, max_lora_rank=16, adapter_pool_bytes=64 * 2**20)
    with live_stack(root, engine=engine, admin_key=ADMIN_KEY, max_upload_bytes=16 * 2**20,
                    max_lora_rank=16) as server, admin_client(server, ADMIN_KEY) as admin:
        key = new_tenant_key(server.services, "acme", "premium")
        server.services.tenancy.ensure_tenant("other", tier="standard")
        for tenant, name, source, visibility in (("acme", "a", "a", "private"), ("acme", "b", "b", "private"),
                                                 ("acme", "c", "c", "private"), ("other", "secret", "a", "private"),
                                                 ("other", "shared", "b", "public")):
            answer = upload(admin, tenant, name, adapters[source], visibility=visibility)
            assert answer.status_code == 201, answer.text
        yield server, admin, key, model_dir


def upload(admin: httpx.Client, tenant: str, name: str, directory: Path, **fields) -> httpx.Response:
    files = {field: (f, (directory / f).read_bytes()) for field, f in (("adapter_config", "adapter_config.json"),
                                                                      ("adapter_model", "adapter_model.safetensors"))}
    return admin.post("/admin/adapters", data={"tenant_id": tenant, "name": name, **fields}, files=files)


def merge_body(name: str, method: str, components: list[dict], **parameters) -> dict:
    return {"tenant_id": "acme", "name": name, "method": method, "components": components, "parameters": parameters}


def stored_counts(server) -> tuple[int, int, int]:
    """(adapter rows, version rows, blobs in the store): what a refused merge must leave unchanged."""
    from sqlalchemy import func, select

    from loramux.db import Adapter, AdapterVersion

    with server.services.db.session() as s:
        adapters_n = s.scalar(select(func.count()).select_from(Adapter))
        versions_n = s.scalar(select(func.count()).select_from(AdapterVersion))
    return adapters_n, versions_n, len(server.services.registry.store.list_keys("blobs/"))


@pytest.mark.parametrize("method, names, weights, parameters", [
    ("cat", ["a", "c"], [1.0, 0.7], {}),
    ("dare_ties", ["a", "b"], [0.9, 0.6], {"density": 0.6, "seed": 7}),
    ("svd", ["a", "b", "c"], [1.0, 0.5, 0.8], {"svd_rank": 6}),
])
def test_a_served_merge_generates_what_peft_merged_model_generates(method, names, weights, parameters, served,
                                                                   adapters, tokenizer):
    server, admin, key, model_dir = served
    components = [{"adapter": n, "weight": w} for n, w in zip(names, weights)]
    answer = admin.post("/admin/adapters/merge", json=merge_body(f"m-{method}", method, components, **parameters))
    assert answer.status_code == 201, answer.text
    merged = answer.json()
    versions = {n: server.services.registry.resolve(server.services.tenancy.tenant("acme").id, n) for n in names}
    assert merged["provenance"]["method"] == method
    assert merged["provenance"]["parameters"] == ({**parameters, "majority_sign_method": "total"}
                                                  if method == "dare_ties" else parameters)
    assert merged["provenance"]["components"] == [
        {"adapter_id": versions[n].adapter_id, "version": 1, "digest": versions[n].digest, "weight": w}
        for n, w in zip(names, weights)]
    model = peft_merged(model_dir, adapters, names, weights, method, parameters).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    base_model = model.get_base_model()
    for ids in PROMPTS:
        with torch.inference_mode():
            want = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(ids):]
            with model.disable_adapter():
                plain = base_model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
        body = {"model": f"m-{method}", "prompt": ids, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
        resp = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120,
                          headers={"Authorization": f"Bearer {key}"})
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["text"] == tokenizer.decode(want.tolist())
        assert want.tolist() != plain[0, len(ids):].tolist()  # the merge changes the answer


def test_provenance_in_the_api_and_a_merge_of_an_existing_name_is_a_new_version(served):
    server, admin, _, _ = served
    first = admin.post("/admin/adapters/merge", json=merge_body("blend", "linear", [{"adapter": "a"},
                                                                                    {"adapter": "b", "weight": 0.5}]))
    assert first.status_code == 201, first.text
    again = admin.post("/admin/adapters/merge", json=merge_body(
        "blend", "ties", [{"adapter": first.json()["id"], "version": 1}, {"adapter": "other/shared", "weight": 0.3}],
        density=0.5))
    assert again.status_code == 201, again.text
    assert again.json()["id"] == first.json()["id"] and again.json()["version"] == 2
    detail = admin.get(f"/admin/adapters/{first.json()['id']}").json()
    v1, v2 = detail["versions"]
    assert v1["provenance"]["method"] == "linear" and v1["provenance"]["parameters"] == {}
    assert v2["provenance"]["components"][0] == {"adapter_id": first.json()["id"], "version": 1,
                                                 "digest": first.json()["digest"], "weight": 1.0}
    assert v2["provenance"]["parameters"] == {"density": 0.5, "majority_sign_method": "total"}
    listed = {a["name"]: a for a in admin.get("/admin/adapters", params={"tenant_id": "acme"}).json()["adapters"]}
    assert listed["blend"]["provenance"]["method"] == "ties" and listed["a"]["provenance"] is None


@pytest.mark.parametrize("body, status, param, words", [
    (merge_body("x", "cat", [{"adapter": "a"}, {"adapter": "nope"}]), 404, None,
     "components[1]: adapter 'nope' not found for tenant 'acme'"),
    (merge_body("x", "cat", [{"adapter": "a"}, {"adapter": "other/secret"}]), 404, None, "components[1]"),
    (merge_body("x", "cat", [{"adapter": "a", "version": 9}, {"adapter": "b"}]), 404, None, "'a@9' not found"),
    (merge_body("x", "linear", [{"adapter": "a"}, {"adapter": "c"}]), 400, "components", "use cat or svd"),
    (merge_body("x", "ties", [{"adapter": "a"}, {"adapter": "b"}]), 400, "parameters.density", "(0, 1]"),
    (merge_body("x", "svd", [{"adapter": "a"}, {"adapter": "b"}], svd_rank=200), 400, "parameters.svd_rank",
     "(32 wide); give parameters.svd_rank <= 32"),
    (merge_body("x", "cat", [{"adapter": "a"}, {"adapter": "b"}, {"adapter": "c"}]), 400, "components",
     "rank 20, above this server's limit of 16"),
    (merge_body("x", "cat", [{"adapter": "a"}, {"adapter": "b"}], seed=3), 400, "parameters.seed",
     "does not apply to method cat"),
    (merge_body("ad_x", "cat", [{"adapter": "a"}, {"adapter": "b"}]), 400, None, "reserved"),
    ({**merge_body("x", "cat", [{"adapter": "a"}, {"adapter": "b"}]), "tenant_id": "ghost"}, 404, None, "ghost"),
])
def test_refusals_name_what_to_fix_and_store_nothing(served, body, status, param, words):
    server, admin, _, _ = served
    before = stored_counts(server)
    answer = admin.post("/admin/adapters/merge", json=body)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert words in error["message"], error
    if param:
        assert error["param"] == param and error["code"] == "invalid_merge"
    assert stored_counts(server) == before


def test_a_merge_whose_store_write_fails_leaves_no_rows_or_blob(served, monkeypatch):
    from loramux.adapters.storage.store import StoreError

    server, admin, _, _ = served
    before = stored_counts(server)

    def broken_put(key, data):
        raise StoreError("the store is down")

    monkeypatch.setattr(server.services.registry.store, "put", broken_put)
    answer = admin.post("/admin/adapters/merge", json=merge_body("broken", "cat", [{"adapter": "a"},
                                                                                   {"adapter": "c"}]))
    assert answer.status_code >= 500
    monkeypatch.undo()
    assert stored_counts(server) == before


def test_the_cli_merges(served):
    import os
    import subprocess

    from loramux.child_python import python_command

    server = served[0]
    env = {**os.environ, "LORAMUX_ADMIN_KEY": ADMIN_KEY, "PYTHONUNBUFFERED": "1"}

    def cli(*args) -> subprocess.CompletedProcess:
        return subprocess.run(python_command("-m", "loramux.cli", "admin", "--url", server.url, "adapters", "merge",
                                             *args), capture_output=True, text=True, timeout=120, env=env)

    done = cli("acme", "cli-blend", "a@1", "c=0.25", "--method", "svd", "--svd-rank", "4")
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    assert answer["name"] == "cli-blend" and answer["version"] == 1 and answer["summary"]["rank"] == 4
    assert answer["provenance"]["parameters"] == {"svd_rank": 4}
    assert [c["weight"] for c in answer["provenance"]["components"]] == [1.0, 0.25]
    refused = cli("acme", "cli-bad", "a", "b", "--method", "dare_linear", "--density", "1.5")
    assert refused.returncode == 1 and "400" in refused.stderr and "parameters.density in (0, 1]" in refused.stderr
    malformed = cli("acme", "cli-bad", "a@x", "b", "--method", "cat")
    assert malformed.returncode == 2 and "the version after '@' must be a number" in malformed.stderr


def _console(server) -> tuple[httpx.Client, str]:
    """A signed-in console client and the adapters page's CSRF token."""
    import re

    client = httpx.Client(base_url=server.url, follow_redirects=False, timeout=60)
    form = client.get("/console/login")
    token = re.search(r'name="csrf_token" value="([^"]+)"', form.text).group(1)
    assert client.post("/console/login", data={"admin_key": ADMIN_KEY, "csrf_token": token}).status_code == 303
    page = client.get("/console/adapters")
    assert page.status_code == 200 and 'id="merge-form"' in page.text
    return client, re.search(r'<meta name="csrf-token" content="([^"]+)"', page.text).group(1)


def test_the_console_merges_and_shows_the_provenance(served):
    server = served[0]
    client, csrf = _console(server)
    acme = server.services.tenancy.tenant("acme")
    form = {"csrf_token": csrf, "tenant_id": acme.id, "name": "console-blend", "visibility": "private",
            "method": "dare_linear", "components": "a=0.5\nb@1=0.5", "density": "0.8", "seed": "11",
            "majority_sign_method": "", "svd_rank": "", "svd_clamp": ""}
    done = client.post("/console/adapters/merge", data=form)
    assert done.status_code == 303, done.text
    page = client.get(done.headers["location"])
    assert page.status_code == 200 and "Adapters merged, validated and stored." in page.text
    b = server.services.registry.resolve(acme.id, "b")
    assert "Version 1 is a merge" in page.text and "<strong>dare_linear</strong>" in page.text
    assert "seed <strong>11</strong>" in page.text and b.digest[:16] in page.text
    refused = client.post("/console/adapters/merge", data={**form, "name": "console-bad", "method": "ties",
                                                           "density": "", "seed": ""})
    assert refused.status_code == 400 and "needs parameters.density in (0, 1]" in refused.text
    unknown = client.post("/console/adapters/merge", data={**form, "components": "a\nnope"})
    assert unknown.status_code == 404 and "components[1]: adapter &#39;nope&#39; not found" in unknown.text
    forged = client.post("/console/adapters/merge", data={**form, "csrf_token": "guessed", "name": "forged"})
    assert forged.status_code == 403
    assert "forged" not in {v.name for v in server.services.registry.list_all(acme.id)}


def _peft_saved(model_dir: Path, path: Path, seed: int, **lora) -> Path:
    """An adapter made by PEFT itself (rank/alpha patterns, layer subsets, rsLoRA), its LoRA weights random."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(**lora))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.3)
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("method, parameters", [("cat", {}), ("svd", {"svd_rank": 5})])
def test_per_module_ranks_scales_and_layer_subsets_merge_as_peft_does(method, parameters, tiny_dir, tiny_cfg,
                                                                      tmp_path):
    dirs = {"patterns": _peft_saved(tiny_dir, tmp_path / "patterns", 1, r=8, lora_alpha=16, use_rslora=True,
                                    target_modules=["q_proj", "v_proj", "down_proj"], rank_pattern={"q_proj": 4},
                                    alpha_pattern={"v_proj": 5}),
            # PEFT gives the merge the first component's layer options and fails on a module of the targets' union
            # that no component has in some layer: this subset is second and only on a module the first has.
            "subset": _peft_saved(tiny_dir, tmp_path / "subset", 2, r=6, lora_alpha=3,
                                  target_modules=["q_proj"], layers_to_transform=[1])}
    names, weights = ["patterns", "subset"], [0.8, 1.3]
    components = [MergeComponent(n, load_adapter_dir(dirs[n], tiny_cfg), w) for n, w in zip(names, weights)]
    check_components(method, parameters, components, tiny_cfg)
    merged = merge(method, check_request(method, parameters, weights), components, tiny_cfg)
    ours = build_adapter("m", merged.config, merged.weights, tiny_cfg)
    want = peft_tensors(peft_merged(tiny_dir, dirs, names, weights, method, parameters))
    assert set(ours.weights) == set(want) and (0, "down_proj") in want
    for key, (a, b, scale) in want.items():
        torch.testing.assert_close(ours.weights[key][0], a, rtol=0, atol=0)
        torch.testing.assert_close(ours.weights[key][1], b, rtol=0, atol=0)
        assert ours.scale_of(key) == scale


@pytest.mark.parametrize("method, parameters", [("cat", {}), ("ties", {"density": 0.5}),
                                                ("dare_linear", {"density": 0.5, "seed": 5}), ("svd", {})])
def test_fused_projections_merge_as_peft_does(method, parameters, tokenizer, tmp_path):
    """Phi-3 fuses q/k/v and gate/up in its checkpoint: the merge sees the fused modules, as PEFT does."""
    from loramux.model.loader import read_model_config

    model_dir = tmp_path / "phi3"
    save_tiny_hf_model(model_dir, len(tokenizer), model_type="phi3", num_key_value_heads=4,
                       pad_token_id=0)
    cfg = read_model_config(model_dir)[0]
    dirs = {name: write_peft_adapter(tmp_path / name, cfg, 8, targets, seed=seed, b_std=0.3)
            for name, targets, seed in (("x", ["qkv_proj", "o_proj"], 1), ("y", ["qkv_proj", "gate_up_proj"], 2))}
    names, weights = ["x", "y"], [0.7, 0.6]
    components = [MergeComponent(n, load_adapter_dir(dirs[n], cfg), w) for n, w in zip(names, weights)]
    checked = check_request(method, parameters, weights)
    merged = merge(method, checked, components, cfg)
    ours = build_adapter("m", merged.config, merged.weights, cfg)
    want = peft_tensors(peft_merged(model_dir, dirs, names, weights, method, parameters))
    assert {t for _, t in want} == {"qkv_proj", "o_proj", "gate_up_proj"}
    q, kv = cfg.q_size, cfg.kv_size
    for (layer, target), (a, b, scale) in want.items():
        parts = {"qkv_proj": (("q_proj", q), ("k_proj", kv), ("v_proj", kv)),
                 "gate_up_proj": (("gate_proj", cfg.intermediate_size), ("up_proj", cfg.intermediate_size))
                 }.get(target, ((target, b.shape[0]),))
        rows = b.split([n for _, n in parts])
        for (part, _), b_rows in zip(parts, rows):
            torch.testing.assert_close(ours.weights[(layer, part)][0], a, rtol=0, atol=0)
            torch.testing.assert_close(ours.weights[(layer, part)][1], b_rows, rtol=0, atol=0)
            assert ours.scale_of((layer, part)) == scale


@pytest.mark.parametrize("lora, words", [
    (dict(target_modules=["q_proj", "embed_tokens"]), "has a LoRA on embed_tokens"),
    (dict(target_modules=["q_proj"], modules_to_save=["lm_head"]), "has trained heads or trainable tokens"),
    (dict(target_modules=["q_proj"], trainable_token_indices=[5, 17]), "has trained heads or trainable tokens"),
])
def test_embedding_and_head_components_are_refused_by_name(lora, words, adapters, tiny_dir, tiny_cfg, tmp_path):
    other = load_adapter_dir(_peft_saved(tiny_dir, tmp_path / "x", 3, r=8, lora_alpha=16, **lora), tiny_cfg)
    components = [MergeComponent("a@1", load_adapter_dir(adapters["a"], tiny_cfg), 1), MergeComponent("x@2", other, 1)]
    with pytest.raises(MergeError) as info:
        check_components("cat", {}, components, tiny_cfg)
    assert info.value.param == "components[1]" and f"component x@2 {words}" in str(info.value)


# ---------------------------------------------------------------------------------------------- bounds

def _one_module_components(cfg, count: int, target: str, hidden: int, intermediate: int, rank: int = 8):
    """A one-layer variant of `cfg` with the given sizes, and `count` random rank-`rank` LoRAs on its `target`
    (LoRA tensors only: nothing dense is built here)."""
    import dataclasses

    from loramux.adapters.formats.peft import LoRAAdapter
    from loramux.adapters.formats.validation import checkpoint_shapes

    big = dataclasses.replace(cfg, hidden_size=hidden, intermediate_size=intermediate, num_layers=1,
                              layer_windows=(), layer_ropes=())
    d_in, d_out = checkpoint_shapes(big)[target]
    g = torch.Generator().manual_seed(count)
    components = []
    for i in range(count):
        weights = {(0, target): (torch.randn(rank, d_in, generator=g), torch.randn(d_out, rank, generator=g))}
        components.append(MergeComponent(f"c{i}@1", LoRAAdapter(f"c{i}", rank, 2.0 * rank, False, (target,), weights),
                                         1.0))
    return big, components


def test_svd_asks_for_thin_matrices_and_gives_the_full_ones_delta(adapters, tiny_dir, tiny_cfg, monkeypatch):
    """PEFT's default, full_matrices=True, allocates a d_out x d_out U (822 MB at 14336 x 4096) for the rank-r
    columns it keeps; the merge asks for the thin one, and the merged deltas equal PEFT's full-matrices ones."""
    from loramux.adapters.composition.merge import _merge_here  # what the worker runs

    names, weights, params = CASES["svd"]
    components = [MergeComponent(n, load_adapter_dir(adapters[n], tiny_cfg), w) for n, w in zip(names, weights)]
    calls, real = [], torch.linalg.svd

    def spy(matrix, *args, **kwargs):
        out = real(matrix, *args, **kwargs)
        calls.append((tuple(matrix.shape), kwargs.get("full_matrices", True), tuple(out[0].shape)))
        return out

    monkeypatch.setattr(torch.linalg, "svd", spy)
    merged = _merge_here("svd", check_request("svd", params, weights), components, tiny_cfg)
    assert calls and all(not full for _, full, _ in calls), calls
    assert all(u == (m, min(m, n)) for (m, n), _, u in calls)
    ours = build_adapter("m", merged.config, merged.weights, tiny_cfg)
    full = peft_tensors(peft_merged(tiny_dir, adapters, names, weights, "svd", {**params, "svd_full_matrices": True}))
    assert set(ours.weights) == set(full)
    for key, (a, b, scale) in full.items():
        torch.testing.assert_close(ours.weights[key][1] @ ours.weights[key][0] * ours.scale_of(key), b @ a * scale,
                                   rtol=1e-4, atol=1e-5)


def test_a_merge_above_the_memory_bound_is_refused_before_it_starts(tiny_cfg):
    """A large merge: 16 components on a 14336 x 4096 projection. PEFT's svd holds each component's dense delta
    three times in its weighted sum: about 10.8 GiB for that module, refused at the default 4 GiB before any worker
    starts; two components fit, and cat of the sixteen (no dense deltas) needs LoRA-sized memory."""
    big, components = _one_module_components(tiny_cfg, 16, "gate_proj", hidden=4096, intermediate=14336, rank=16)
    dense = 14336 * 4096 * 4
    need, why = peak_bytes("svd", {}, components, big)
    assert 49 * dense <= need < 49 * dense + 2**30, need
    assert "16 components' dense 14336 x 4096 deltas" in why
    limits = MergeLimits(memory_bytes=4 * 1024**3, timeout_s=7.0)  # LORAMUX_MERGE_MEMORY_BYTES's default
    with pytest.raises(MergeTooLarge) as info:
        merge("svd", {}, components, big, limits)
    message = str(info.value)
    assert info.value.code == "too_large" and info.value.param == "components"
    assert "above this server's merge memory limit of 4.00 GiB (LORAMUX_MERGE_MEMORY_BYTES=4294967296)" in message
    assert "layer 0 gate_proj: 16 components' dense 14336 x 4096 deltas" in message and "raise" in message
    assert merge_pool(limits).started == []  # no worker started: nothing was allocated for the merge
    assert check_memory("svd", {}, components[:2], big, limits.memory_bytes) < limits.memory_bytes
    assert peak_bytes("cat", {}, components, big)[0] < 256 * 2**20  # LoRA-sized: 16 x 1.2 MB in, rank 256 out


def test_a_worker_merge_past_its_memory_limit_stops_in_the_worker(tiny_cfg):
    """RLIMIT_AS in the worker: a merge that outgrows its bound (here past the estimate, run on the pool directly,
    as an underestimate would) fails in its own process with a 413 naming the setting; the worker is reaped."""
    big, components = _one_module_components(tiny_cfg, 2, "gate_proj", hidden=2048, intermediate=2048)
    limits = MergeLimits(memory_bytes=64 * 2**20, timeout_s=120.0)  # 7 dense 16 MiB deltas do not fit
    pool = merge_pool(limits)
    with pytest.raises(MergeTooLarge, match=r"ran out of its memory limit of 0\.06 GiB \(LORAMUX_MERGE_MEMORY_BYTES="):
        pool.run("svd", {}, components, big)
    assert len(pool.started) == 1 and pool.live_pids() == []
    assert not Path(f"/proc/{pool.started[0]}").exists()  # gone and reaped, not a zombie


def test_a_merge_past_its_time_limit_is_killed_and_leaves_nothing(served, monkeypatch, tmp_path):
    """A worker past LORAMUX_MERGE_TIMEOUT_S is killed: a 413 naming the setting, no process (not even a zombie),
    no temporary file or shared-memory segment, no row, no blob. The tiny limit is shorter than the worker's own
    start (importing torch and PEFT), so the kill always comes while it runs."""
    import os
    import tempfile

    server, admin, _, _ = served
    settings = server.services.settings
    monkeypatch.setattr(settings, "merge_timeout_s", 0.2)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))  # the worker inherits it
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    shm_before = set(os.listdir("/dev/shm"))
    before = stored_counts(server)
    answer = admin.post("/admin/adapters/merge", json=merge_body("slow", "svd", [{"adapter": "a"}, {"adapter": "b"}]))
    assert answer.status_code == 413, answer.text
    error = answer.json()["error"]
    assert error["code"] == "too_large" and error["param"] == "components"
    assert "longer than this server's merge time limit of 0.2 s (LORAMUX_MERGE_TIMEOUT_S)" in error["message"]
    pool = merge_pool(MergeLimits.from_settings(settings))
    assert len(pool.started) == 1 and pool.live_pids() == []
    pid = pool.started[0]
    assert not Path(f"/proc/{pid}").exists()
    assert list(scratch.iterdir()) == []
    assert not [n for n in set(os.listdir("/dev/shm")) - shm_before if str(pid) in n or str(os.getpid()) in n]
    assert stored_counts(server) == before


def test_a_merge_above_the_memory_bound_over_http_is_a_413_naming_the_setting(served, monkeypatch):
    server, admin, _, _ = served
    monkeypatch.setattr(server.services.settings, "merge_memory_bytes", 16 * 2**20)
    before = stored_counts(server)
    answer = admin.post("/admin/adapters/merge", json=merge_body("huge", "ties", [{"adapter": "a"}, {"adapter": "b"}],
                                                                 density=0.5))
    assert answer.status_code == 413, answer.text
    error = answer.json()["error"]
    assert error["code"] == "too_large" and error["param"] == "components"
    assert "memory at its peak" in error["message"]
    assert "(LORAMUX_MERGE_MEMORY_BYTES=16777216); merge fewer or smaller components, or raise" in error["message"]
    assert merge_pool(MergeLimits.from_settings(server.services.settings)).started == []
    assert stored_counts(server) == before


def test_a_merge_with_every_worker_busy_is_a_503(served, monkeypatch):
    server, admin, _, _ = served
    settings = server.services.settings
    monkeypatch.setattr(settings, "merge_timeout_s", 0.1)
    pool = merge_pool(MergeLimits.from_settings(settings))
    assert pool._slots.acquire(blocking=False)  # the one worker (LORAMUX_MERGE_WORKERS=1) taken
    try:
        answer = admin.post("/admin/adapters/merge", json=merge_body("busy", "dare_linear",
                                                                     [{"adapter": "a"}, {"adapter": "b"}], density=0.5))
    finally:
        pool._slots.release()
    assert answer.status_code == 503, answer.text
    assert answer.json()["error"]["code"] == "merge_busy" and "Retry-After" in answer.headers
    assert "every merge worker (1, LORAMUX_MERGE_WORKERS) stayed busy" in answer.json()["error"]["message"]
    assert pool.started == []
