"""vLLM's adapter endpoints (`/v1/load_lora_adapter`, `/v1/unload_lora_adapter`) and the resolver, on a live server
over the tiny model with adapters in moto S3: what they serve equals PEFT, an unload frees the adapter's host and
device copies, a reload under the same name serves the new weights (no stale KV or device copy), concurrent first
requests for an adapter only the resolver's store holds share one fetch and one registry row, and every bad input
is refused with the right status and a message that says what to fix."""
from __future__ import annotations

import concurrent.futures
import json
import uuid

import boto3
import httpx
import openai
import pytest

from conftest import adapter_files, live_stack, new_tenant_key, peft_greedy_texts
from loramux.model.loader import read_model_config
from loramux.testing import write_peft_adapter
from loramux.testing.services import MOTO_CREDENTIALS, MOTO_REGION, moto_create_bucket
from polling import wait_until

ADMIN_KEY = "lmxa-vllm-endpoints-admin-key-0123456789abcdefgh"
TARGETS = ["q_proj", "v_proj", "down_proj"]
PROMPT = [1, 450, 3200, 17, 99, 23001, 871]  # token ids: exactly what PEFT gets
NEW_TOKENS = 8
NAMES = ("first", "second", "third")


@pytest.fixture(scope="module")
def adapters(tiny_dir, tmp_path_factory, tokenizer):
    """({name: its PEFT directory}, {name or None: PEFT's greedy text for PROMPT})."""
    cfg, _ = read_model_config(tiny_dir)
    root = tmp_path_factory.mktemp("vllm-adapters")
    dirs = {name: write_peft_adapter(root / name, cfg, 4, TARGETS, seed=300 + i, b_std=1.0)
            for i, name in enumerate(NAMES)}
    expected = peft_greedy_texts(tiny_dir, tokenizer, dirs, PROMPT, NEW_TOKENS)
    assert len(set(expected.values())) == len(expected)  # each adapter really changes the output
    return dirs, expected


def misshapen_adapter(directory, source):
    """A copy of the adapter at `source` with one lora_A transposed: shapes that cannot fit the base model."""
    from safetensors.torch import load_file, save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "adapter_config.json").write_bytes((source / "adapter_config.json").read_bytes())
    tensors = load_file(source / "adapter_model.safetensors")
    name = next(n for n in sorted(tensors) if n.endswith("lora_A.weight"))
    tensors[name] = tensors[name].t().contiguous()
    save_file(tensors, directory / "adapter_model.safetensors")
    return directory


def put_dir(s3, bucket: str, prefix: str, directory, files=("adapter_config.json", "adapter_model.safetensors")):
    for name in files:
        s3.upload_file(str(directory / name), bucket, f"{prefix}/{name}")


@pytest.fixture(scope="module")
def stack(tiny_dir, tokenizer, tmp_path_factory, moto_server, adapters):
    """A server whose adapter endpoints read moto S3 and the local root `<tmp>/imports`, with a resolver at
    s3://<bucket>/resolver/; tenants `acme` (keys) and `globex`. Yields a dict of what tests use."""
    tmp = tmp_path_factory.mktemp("vllm-endpoints")
    bucket = f"loramux-import-{uuid.uuid4().hex[:12]}"
    moto_create_bucket(moto_server, bucket)
    s3 = boto3.client("s3", endpoint_url=moto_server, region_name=MOTO_REGION,
                      aws_access_key_id=MOTO_CREDENTIALS["access_key_id"],
                      aws_secret_access_key=MOTO_CREDENTIALS["secret_access_key"])
    dirs = adapters[0]
    for name, path in dirs.items():
        put_dir(s3, bucket, f"rollout/{name}", path)
    put_dir(s3, bucket, "resolver/acme/only-in-s3", dirs["third"])
    imports = tmp / "imports"
    imports.mkdir()
    with live_stack(tmp, tiny_dir, tokenizer, engine=dict(max_lora_rank=8, max_num_seqs=32), admin_key=ADMIN_KEY,
                    auth_failures_per_min=0, s3_endpoint_url=moto_server, s3_region=MOTO_REGION,
                    s3_access_key_id=MOTO_CREDENTIALS["access_key_id"],
                    s3_secret_access_key=MOTO_CREDENTIALS["secret_access_key"], adapter_import_roots=str(imports),
                    adapter_resolver=f"s3://{bucket}/resolver/", adapter_resolver_miss_ttl_s=600) as server:
        key = new_tenant_key(server.services, "acme", "standard")
        new_tenant_key(server.services, "globex", "standard")
        yield {"server": server, "key": key, "bucket": bucket, "s3": s3, "imports": imports, "dirs": dirs,
               "expected": adapters[1], "tmp": tmp}


def admin_post(stack, route: str, body: dict, tenant: str | None = "acme", key: str = ADMIN_KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"}
    if tenant is not None:
        headers["X-Loramux-Tenant"] = tenant
    return httpx.post(f"{stack['server'].url}/v1/{route}", json=body, headers=headers, timeout=120)


def complete(stack, model: str) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    return httpx.post(f"{stack['server'].url}/v1/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {stack['key']}"})


def text_of(resp: httpx.Response) -> str:
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["text"]


def held_bytes(server) -> tuple[int, int]:
    """(host RAM bytes of the adapter cache, device bytes of the engine's adapter pool)."""
    lora = server.services.engine.stats()["lora"]
    return server.services.adapter_cache.stats()["host_bytes"], lora["device_bytes"]


def engine_is_idle(server) -> bool:
    stats = server.services.engine.stats()
    return stats["running"] == 0 and stats["waiting"] == 0


def test_load_serve_unload_and_reload_under_the_same_name(stack):
    server, bucket, expected = stack["server"], stack["bucket"], stack["expected"]
    before = held_bytes(server)

    resp = admin_post(stack, "load_lora_adapter", {"lora_name": "rolled", "lora_path": f"s3://{bucket}/rollout/first/"})
    assert resp.status_code == 200, resp.text
    assert resp.text == "Success: LoRA adapter 'rolled' added successfully."
    first_id = resp.headers["X-Loramux-Adapter-Id"]
    assert text_of(complete(stack, "rolled")) == expected["first"]
    loaded = held_bytes(server)
    assert loaded[0] > before[0] and loaded[1] > before[1]  # in host RAM and on the device

    # A second load of the name is vLLM's 400; the same call with load_inplace adds nothing for the same bytes.
    again = admin_post(stack, "load_lora_adapter", {"lora_name": "rolled", "lora_path": f"s3://{bucket}/rollout/first"})
    assert again.status_code == 400 and "already loaded" in again.json()["error"]["message"]

    resp = admin_post(stack, "unload_lora_adapter", {"lora_name": "rolled"})
    assert resp.status_code == 200 and resp.text == "Success: LoRA adapter 'rolled' removed successfully."
    gone = complete(stack, "rolled")
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
    wait_until(lambda: held_bytes(server) == before, "the unloaded adapter's host and device copies are freed", 30)

    # The same name, other weights: the answer is the new adapter's (the prompt is the same, so a prefix cache or
    # device copy keyed by name would give the old one's).
    resp = admin_post(stack, "load_lora_adapter", {"lora_name": "rolled",
                                                  "lora_path": f"s3://{bucket}/rollout/second/"})
    assert resp.status_code == 200, resp.text
    assert resp.headers["X-Loramux-Adapter-Id"] != first_id
    assert text_of(complete(stack, "rolled")) == expected["second"]
    assert text_of(complete(stack, "rolled")) == expected["second"]  # again, now from the prefix cache

    # load_inplace: a new version of the name, served at once.
    resp = admin_post(stack, "load_lora_adapter", {"lora_name": "rolled", "load_inplace": True,
                                                  "lora_path": f"s3://{bucket}/rollout/first/"})
    assert resp.status_code == 200 and resp.headers["X-Loramux-Adapter-Version"] == "2"
    assert text_of(complete(stack, "rolled")) == expected["first"]
    assert admin_post(stack, "unload_lora_adapter", {"lora_name": "rolled"}).status_code == 200
    wait_until(lambda: engine_is_idle(server) and held_bytes(server) == before, "freed again", 30)


def test_a_directory_under_an_import_root_loads(stack):
    directory = stack["imports"] / "local-one"
    directory.mkdir()
    for name, path in adapter_files(stack["dirs"]["first"]).items():
        (directory / name).write_bytes(path.read_bytes())
    resp = admin_post(stack, "load_lora_adapter", {"lora_name": "local-one", "lora_path": str(directory)},
                      tenant=None)
    assert resp.status_code == 400 and "X-Loramux-Tenant" in resp.json()["error"]["message"]  # no tenant named
    resp = admin_post(stack, "load_lora_adapter", {"lora_name": "local-one", "lora_path": directory.as_uri()})
    assert resp.status_code == 200, resp.text
    assert text_of(complete(stack, "local-one")) == stack["expected"]["first"]
    assert admin_post(stack, "unload_lora_adapter", {"lora_name": "local-one"}).status_code == 200


def test_bad_loads_are_refused_with_what_to_fix(stack, tiny_dir):
    bucket, imports, tmp = stack["bucket"], stack["imports"], stack["tmp"]
    outside = tmp / "outside"
    outside.mkdir(exist_ok=True)
    for name, path in adapter_files(stack["dirs"]["first"]).items():
        (outside / name).write_bytes(path.read_bytes())
    (imports / "escape").symlink_to(outside, target_is_directory=True)
    pickled = imports / "pickled"
    pickled.mkdir()
    (pickled / "adapter_config.json").write_bytes((stack["dirs"]["first"] / "adapter_config.json").read_bytes())
    (pickled / "adapter_model.bin").write_bytes(b"not loaded")
    (imports / "loop").symlink_to(imports / "loop")
    put_dir(stack["s3"], bucket, "rollout/misshapen", misshapen_adapter(tmp / "misshapen", stack["dirs"]["first"]))
    config = json.loads((stack["dirs"]["first"] / "adapter_config.json").read_text())
    stack["s3"].put_object(Bucket=bucket, Key="rollout/no-weights/adapter_config.json", Body=json.dumps(config))

    cases = [  # (body, tenant header, status, words in the message)
        ({"lora_name": "x", "lora_path": str(outside)}, "acme", 400, "not under an allowed root"),
        ({"lora_name": "x", "lora_path": str(imports / "escape")}, "acme", 400, "not under an allowed root"),
        ({"lora_name": "x", "lora_path": f"{imports}/../outside"}, "acme", 400, "'..'"),
        ({"lora_name": "x", "lora_path": "relative/dir"}, "acme", 400, "absolute directory"),
        ({"lora_name": "x", "lora_path": "http://example.com/a"}, "acme", 400, "unsupported adapter location"),
        ({"lora_name": "x", "lora_path": str(pickled)}, "acme", 400, "pickle weights"),
        ({"lora_name": "x", "lora_path": str(imports / "missing")}, "acme", 404, "no adapter directory"),
        ({"lora_name": "x", "lora_path": f"{(imports / 'a').as_uri()}%00b"}, "acme", 400, "control characters"),
        ({"lora_name": "x", "lora_path": str(imports / "loop")}, "acme", 400, "cannot read"),
        ({"lora_name": "x", "lora_path": str(imports / ("n" * 300))}, "acme", 400, "cannot read"),
        ({"lora_name": "x", "lora_path": f"s3://{bucket}/rollout/nothing-here/"}, "acme", 404, "adapter_config.json"),
        ({"lora_name": "x", "lora_path": f"s3://{bucket}/rollout/no-weights/"}, "acme", 400, "no adapter_model"),
        ({"lora_name": "x", "lora_path": f"s3://{bucket}/rollout/../rollout/first/"}, "acme", 400, "'..'"),
        ({"lora_name": "x", "lora_path": f"s3://{bucket}/rollout/misshapen/"}, "acme", 400, "shape"),
        ({"lora_name": "../x", "lora_path": f"s3://{bucket}/rollout/first/"}, "acme", 400, "adapter name"),
        ({"lora_name": "base", "lora_path": f"s3://{bucket}/rollout/first/"}, "acme", 400, "reserved"),
        ({"lora_name": "x", "lora_path": f"s3://{bucket}/rollout/first/"}, "nobody", 404, "nobody"),
        ({"lora_name": "x"}, "acme", 422, "lora_path"),
    ]
    for body, tenant, status, words in cases:
        resp = admin_post(stack, "load_lora_adapter", body, tenant=tenant)
        assert resp.status_code == status, (body, resp.text)
        assert words in resp.json()["error"]["message"], (body, resp.text)
    assert stack["server"].services.registry.list_all(None) == []  # nothing half-registered

    resp = admin_post(stack, "unload_lora_adapter", {"lora_name": "never-loaded"})
    assert resp.status_code == 404 and "never-loaded" in resp.json()["error"]["message"]
    # A tenant key is not an admin key: vLLM's endpoints are operations on the server.
    resp = admin_post(stack, "load_lora_adapter", {"lora_name": "x", "lora_path": f"s3://{bucket}/rollout/first/"},
                      key=stack["key"])
    assert resp.status_code == 403


def test_the_resolver_serves_an_s3_only_adapter_once_under_16_concurrent_first_requests(stack):
    server, expected = stack["server"], stack["expected"]
    resolver = server.app.state.pipeline.resolver
    lookups = resolver.lookups
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        texts = list(pool.map(lambda _: text_of(complete(stack, "only-in-s3")), range(16)))
    assert texts == [expected["third"]] * 16
    assert resolver.lookups == lookups + 1  # one fetch from the store
    acme = server.services.tenancy.tenant("acme").id
    rows = [v for v in server.services.registry.list_all(acme) if v.name == "only-in-s3"]
    assert len(rows) == 1 and rows[0].version == 1  # one registry row, version 1
    assert text_of(complete(stack, "only-in-s3")) == expected["third"]  # now from the registry
    assert resolver.lookups == lookups + 1

    # Unloaded stays unloaded: the resolver does not fetch it back.
    assert admin_post(stack, "unload_lora_adapter", {"lora_name": "only-in-s3"}).status_code == 200
    gone = complete(stack, "only-in-s3")
    assert gone.status_code == 404 and resolver.lookups == lookups + 1


def test_the_resolver_refuses_unknown_and_hostile_names(stack):
    resolver = stack["server"].app.state.pipeline.resolver
    lookups = resolver.lookups
    for _ in range(3):  # a miss is looked up once, then remembered
        resp = complete(stack, "not-anywhere")
        assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found"
    assert resolver.lookups == lookups + 1
    for hostile in ("../x", "..", "a/../../b", "x\\y", "/etc/passwd", "-x", "x" * 129):
        resp = complete(stack, hostile)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "model", (hostile, resp.text)
        assert "cannot be resolved" in resp.json()["error"]["message"]
    for reference in ("ad_0123456789", "not-anywhere-either@2", "acme/not-here"):  # the registry's own references
        assert complete(stack, reference).status_code == 404, reference
    assert resolver.lookups == lookups + 1
    # Another tenant's name space is its own: globex cannot reach acme's resolver directory.
    assert "globex" not in {v.name for v in stack["server"].services.registry.list_all(None)}


def test_the_resolver_says_why_an_adapter_in_its_store_cannot_be_served(stack):
    put_dir(stack["s3"], stack["bucket"], "resolver/acme/too-big",
            misshapen_adapter(stack["tmp"] / "resolver-misshapen", stack["dirs"]["second"]))
    resolver = stack["server"].app.state.pipeline.resolver
    lookups = resolver.lookups
    for _ in range(2):  # the second answer is remembered: no second download
        resp = complete(stack, "too-big")
        assert resp.status_code == 400, resp.text
        message = resp.json()["error"]["message"]
        assert "shape" in message and resp.json()["error"]["param"] == "model"
        assert stack["bucket"] not in message and "resolver/" not in message  # the store is the operator's
    assert resolver.lookups == lookups + 1
    acme = stack["server"].services.tenancy.tenant("acme").id
    assert "too-big" not in {v.name for v in stack["server"].services.registry.list_all(acme)}


def test_models_list_shows_the_tenants_adapters_with_their_parent(stack):
    bucket = stack["bucket"]
    assert admin_post(stack, "load_lora_adapter", {"lora_name": "listed",
                                                  "lora_path": f"s3://{bucket}/rollout/first/"}).status_code == 200
    assert admin_post(stack, "load_lora_adapter", {"lora_name": "theirs", "lora_path": f"s3://{bucket}/rollout/second/"},
                      tenant="globex").status_code == 200
    client = openai.OpenAI(base_url=f"{stack['server'].url}/v1", api_key=stack["key"], max_retries=0)
    models = {m.id: m for m in client.models.list()}
    base = stack["server"].app.state.pipeline.model_id
    assert base in models and "listed" in models and "theirs" not in models
    assert models["listed"].model_extra["parent"] == base and models[base].model_extra["parent"] is None
    reference = models["listed"].model_extra["root"]  # what the routers' metrics name it by: also a valid model
    assert reference.startswith("ad_") and reference.endswith("@1")
    assert text_of(complete(stack, reference)) == stack["expected"]["first"]
    assert models["listed"].model_extra["max_model_len"] == stack["server"].services.engine.max_model_len


def test_a_store_the_resolver_cannot_read_is_a_503_that_names_no_bucket(stack, monkeypatch):
    resolver = stack["server"].app.state.pipeline.resolver
    monkeypatch.setattr(resolver, "url", "s3://loramux-no-such-bucket-here/resolver/")
    resp = complete(stack, "anything-new")
    assert resp.status_code == 503 and resp.headers["Retry-After"], resp.text
    message = resp.json()["error"]["message"]
    assert "could not be read from the adapter store" in message and "no-such-bucket" not in message
