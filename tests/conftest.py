"""Shared fixtures: the embedded SmolLM2 (converted once into the cache dir) and tiny random Llamas."""
from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels run on CPU tensors (set before import)

from lanes import (  # noqa: F401  (the test lanes' hooks: markers at collection, --lane-budget)
    pytest_addoption,
    pytest_collection_modifyitems,
    pytest_configure,
    pytest_sessionfinish,
    pytest_terminal_summary,
)
from loramux.engine.config import EngineConfig
from loramux.engine.engine import LLMEngine
from loramux.model.loader import build_model, end_of_turn_ids, resolve_model_dir
from loramux.settings import DEFAULT_MODEL, Settings
from loramux.testing import (
    MOTO_CREDENTIALS,
    MOTO_REGION,
    LiveServer,
    moto_create_bucket,
    save_tiny_hf_model,
    start_moto_server,
    start_redis_server,
    stop_moto_server,
)

# At most 2 threads, as CI has (a cap, not a setting: raising 1 thread pinned to one core to 2 made every
# OpenMP region spin-wait on a descheduled thread, ~100x slower). Under pytest-xdist (`make test` runs 2
# workers) each worker, and every process it starts, gets 1: two workers of 2 threads on 2 cores would be that
# oversubscription again.
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if XDIST_WORKER is not None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
elif torch.get_num_threads() > 2:
    torch.set_num_threads(2)


def embedded_model_dir() -> Path:
    """HF-style directory of the embedded SmolLM2-135M-Instruct, converted from its GGUF on first use under an
    exclusive file lock: test processes running side by side (xdist workers) convert it once between them, and
    none reads the cache dir while another is still replacing it."""
    import fcntl

    cache_dir = Path(Settings().cache_dir)
    (cache_dir / "models").mkdir(parents=True, exist_ok=True)
    with open(cache_dir / "models" / f".{DEFAULT_MODEL}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        return resolve_model_dir(DEFAULT_MODEL, cache_dir)


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session):
    """Convert the embedded model before the first test when any selected test needs it: the bench scripts and
    CLIs that the `subprocess` tests start resolve it themselves, without the lock."""
    if not session.config.option.collectonly and any(item.get_closest_marker("real_model") for item in session.items):
        embedded_model_dir()


@pytest.fixture(scope="session")
def smol_dir() -> Path:
    """HF-style directory of the embedded SmolLM2-135M-Instruct (GGUF converted on first use)."""
    return embedded_model_dir()


@pytest.fixture(scope="session")
def tokenizer(smol_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smol_dir)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory, tokenizer) -> Path:
    """A 2-layer random Llama with the SmolLM2 vocabulary, so the real tokenizer detokenises its output."""
    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_hf_model(path, vocab_size=len(tokenizer))
    return path


def make_engine(model_dir: Path, tokenizer, **config) -> LLMEngine:
    model, cfg = build_model(model_dir, torch.float32, torch.device("cpu"))
    engine_config = EngineConfig(**{"num_blocks": 256, "block_size": 16, "max_num_seqs": 32,
                                    "max_num_batched_tokens": 256, "max_model_len": 512, **config})
    return LLMEngine(model, tokenizer, engine_config, end_of_turn_ids(tokenizer, cfg, model_dir))


@pytest.fixture
def tiny_engine(tiny_dir, tokenizer) -> LLMEngine:
    return make_engine(tiny_dir, tokenizer)


# --- S3 (moto server) ------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def moto_server():
    """An S3-compatible moto server on 127.0.0.1 for the whole session; yields its endpoint URL."""
    server = start_moto_server()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        stop_moto_server(server)


@pytest.fixture
def s3_store(moto_server):
    """An S3Store on a fresh, uniquely named bucket of the session's moto server."""
    import uuid

    from loramux.adapters.storage.store import S3Store

    bucket = f"loramux-test-{uuid.uuid4().hex[:16]}"
    moto_create_bucket(moto_server, bucket)
    return S3Store(bucket, endpoint_url=moto_server, region=MOTO_REGION, timeout_s=5.0, **MOTO_CREDENTIALS)


# --- SQL: every database test runs on SQLite and on PostgreSQL ------------------------------------
POSTGRES_URL = os.environ.get("LORAMUX_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


@pytest.fixture(scope="session")
def postgres_server_url():
    """A scratch PostgreSQL database for this test session (created from the `test` database, dropped at
    the end), so parallel sessions and leftovers never collide."""
    import uuid

    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    admin = create_engine(POSTGRES_URL, isolation_level="AUTOCOMMIT")
    name = f"loramux_test_{uuid.uuid4().hex[:12]}"
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"PostgreSQL at {POSTGRES_URL} is needed for the SQL tests: {exc}")
    url = make_url(POSTGRES_URL).set(database=name).render_as_string(hide_password=False)
    yield url
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request, tmp_path):
    """An empty database (no tables), on SQLite and on PostgreSQL."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'loramux.db'}"
        return
    from sqlalchemy import create_engine, text

    url = request.getfixturevalue("postgres_server_url")
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(text("DROP SCHEMA public CASCADE"))
        conn.execute(text("CREATE SCHEMA public"))
    engine.dispose()
    yield url


@pytest.fixture
def database(database_url):
    """A migrated `loramux.db.Database`, on SQLite and on PostgreSQL."""
    from loramux.db import Database

    db = Database(database_url)
    db.upgrade()
    yield db
    db.dispose()


def make_services(tmp_path: Path, engine: LLMEngine, **settings):
    """Services (SQLite registry + file store in tmp_path unless overridden) around a given engine."""
    from loramux.services.container import Services

    return Services.from_settings(Settings(data_dir=tmp_path / "data", **settings), engine=engine)


def new_tenant_key(services, name: str = "acme", tier: str = "standard") -> str:
    """Create a tenant (if new) and a fresh API key for it; returns the raw key."""
    services.tenancy.ensure_tenant(name, tier=tier)
    return services.tenancy.create_key(name)[1]


@contextmanager
def live_stack(tmp: Path, tiny_dir: Path | None = None, tokenizer=None, *, engine: dict | LLMEngine | None = None,
               client: bool | dict = False, ledger_hooks: list | None = None, limiter_factory=None, **settings):
    """The app on the tiny model, as the HTTP tests build it: `create_app` over make_services(tmp, engine,
    **settings), the engine made at the app's start by make_engine(tiny_dir, tokenizer, **engine) (or `engine`
    itself when it is one already). Yields a LiveServer (uvicorn on a free port; its `.services`), or with
    `client` a TestClient (`client` may be the TestClient's keyword arguments; `.app.state.services`)."""
    from fastapi.testclient import TestClient

    from loramux.server.app import create_app

    def services():
        built = engine if isinstance(engine, LLMEngine) else make_engine(tiny_dir, tokenizer, **(engine or {}))
        return make_services(tmp, built, **settings)

    app = create_app(services, ledger_hooks=ledger_hooks,
                     **({"limiter_factory": limiter_factory} if limiter_factory is not None else {}))
    with (TestClient(app, **(client if isinstance(client, dict) else {})) if client else LiveServer(app)) as served:
        yield served


ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def serve_admin_stack(tmp: Path, tiny_dir: Path, tokenizer, admin_key: str):
    """For a module fixture: a live server on the tiny model (2 adapter slots, uploads up to 256 KiB) with
    `admin_key` and a standard tenant `acme`; yields (server, acme's key, the model config, tmp)."""
    from loramux.model.loader import read_model_config

    # The auth tests here send many keyless and bad-key requests from one client address: the per-address
    # failed-authentication limit (tested in test_auth_hardening.py) is off for them.
    with live_stack(tmp, tiny_dir, tokenizer, engine={"max_loras": 2, "max_lora_rank": 8}, admin_key=admin_key,
                    max_upload_bytes=256 * 1024, auth_failures_per_min=0) as server:
        yield server, new_tenant_key(server.services, "acme", "standard"), read_model_config(tiny_dir)[0], tmp


def admin_client(server, admin_key: str):
    """An httpx client of a live `server`'s admin API, authenticated with `admin_key`. Use it in a `with`
    (a fixture's), which closes its connections."""
    import httpx

    return httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {admin_key}"}, timeout=60)


def server_stats(client) -> dict:
    """/admin/stats (engine-wide state, operators only) through a TestClient, with a fresh admin key."""
    key = client.app.state.services.admin_keys.create("test stats")[1]
    return client.get("/admin/stats", headers={"Authorization": f"Bearer {key}"}).json()


def adapter_files(path: Path) -> dict[str, Path]:
    """The two files of a PEFT adapter directory, as the registry's `register` takes them."""
    return {name: path / name for name in ADAPTER_FILES}


@pytest.fixture(scope="session")
def tiny_cfg(tiny_dir):
    """The ModelConfig of the tiny random Llama."""
    from loramux.model.loader import read_model_config

    return read_model_config(tiny_dir)[0]


def run_to_completion(engine: LLMEngine, requests) -> list:
    """Add every (prompt, params, adapter) request at once; step until all finish; outputs in order."""
    ids = []
    for i, (prompt, params, adapter) in enumerate(requests):
        rid = f"r{i}-{id(requests)}"
        engine.add_request(rid, prompt, params, adapter=adapter)
        ids.append(rid)
    final = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return [final[r] for r in ids]


def drafts_expected(prompt: list[int], output: list[int]) -> bool:
    """Whether prompt lookup has something to draft at some decode step of this request: a token produced
    before the last one that already occurred earlier in its context (the engine looks up n-grams down to 1)."""
    context = list(prompt)
    for token in output[:-1]:
        if token in context:
            return True
        context.append(token)
    return False


def family_engine(model_dir: Path, tokenizer) -> LLMEngine:
    """The engine the model-family tests compare with HF: float32 on CPU, blocks of 4, prefix caching and 3-token
    prompt-lookup speculation on, adapters loaded inline."""
    model, cfg = build_model(model_dir, torch.float32, torch.device("cpu"))
    config = EngineConfig(block_size=4, num_blocks=256, max_num_seqs=8, max_num_batched_tokens=64,
                          max_model_len=256, prefix_caching=True, speculative_tokens=3, speculative_max_batch=8,
                          async_adapter_loads=False)
    return LLMEngine(model, tokenizer, config, end_of_turn_ids(tokenizer, cfg, model_dir))


def greedy_tokens(engine: LLMEngine, requests: dict[str, tuple[list[int], str | None]], new_tokens: int
                  ) -> dict[str, list[int]]:
    """Run the requests (id -> (prompt, adapter)) together, greedy, exactly `new_tokens` each: id -> tokens."""
    from loramux.engine.sampling.params import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    outs = run_to_completion(engine, [(ids, params, adapter) for ids, adapter in requests.values()])
    return {rid: out.token_ids for rid, out in zip(requests, outs)}


def hf_greedy(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """HF `generate`'s greedy continuation of each prompt alone, `new_tokens` tokens each."""
    outs = []
    for ids in prompts:
        with torch.inference_mode():
            out = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False)
        outs.append(out[0, len(ids):].tolist())
    return outs


def peft_greedy_texts(model_dir: Path, tokenizer, adapter_dirs: dict, prompt: list[int], new_tokens: int) -> dict:
    """{adapter name or None (the base model): the text HF transformers + PEFT generate greedily for `prompt`},
    exactly `new_tokens` tokens each (no EOS stop, as the server's ignore_eos), each adapter on a fresh base."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    def fresh_base():
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        base.generation_config.eos_token_id = None
        base.generation_config.pad_token_id = 0
        return base

    def greedy(model) -> str:
        return tokenizer.decode(hf_greedy(model, [prompt], new_tokens)[0])

    expected = {None: greedy(fresh_base())}
    for name, path in adapter_dirs.items():
        expected[name] = greedy(PeftModel.from_pretrained(fresh_base(), path).eval())
    return expected


def decode_step_lora_cost(engine: LLMEngine, requests: dict[str, str | None], prompt) -> tuple[int, int]:
    """LoRA multiply-adds and weight bytes of one decode step of `requests` (id -> adapter), each started with
    `prompt` and past its prefill; the requests are aborted afterwards."""
    from loramux.engine.sampling.params import SamplingParams

    for rid, adapter in requests.items():
        engine.add_request(rid, prompt, SamplingParams(max_tokens=4, ignore_eos=True), adapter=adapter)
    while any(engine.requests[r].seq.is_prefill or engine.requests[r].seq.status.value != "running"
              for r in requests):
        engine.step()
    engine.pool.wrapper.cost.reset()
    engine.step()
    cost = engine.pool.wrapper.cost
    for rid in requests:
        engine.abort_request(rid)
    return cost.macs, cost.weight_bytes


# --- Redis: shared rate limits and replica state (scale-out tests) ---------------------------------
@pytest.fixture(scope="session")
def redis_url():
    """A private redis-server on a free port for this session (nothing on disk); without the binary, the
    machine's Redis (LORAMUX_TEST_REDIS_URL, default db 15 on 127.0.0.1:6379), flushed first: xdist worker gwN
    takes the database N below the URL's, so that one worker's flush never wipes another's keys."""
    import shutil

    import redis

    binary = shutil.which("redis-server")
    if binary is None:
        url = os.environ.get("LORAMUX_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
        worker = int((XDIST_WORKER or "gw0").removeprefix("gw"))
        if worker:
            root, _, db = url.rpartition("/")
            url = f"{root}/{int(db) - worker}"
        redis.Redis.from_url(url).flushdb()
        yield url
        return
    server = start_redis_server(binary)
    yield server.url
    server.process.terminate()
    server.process.wait(timeout=10)


# --- Ray: one local cluster for the Ray tests' module -----------------------------------------------
@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster, started once (Ray takes 10-20 s to start on 2 cores) for the one module that holds
    every Ray test (tests/lanes.py, ONE_MODULE_LANES) and shut down at its end, since an idle cluster's daemons
    keep taking CPU from the tests after it; yields the `ray` module. The module shuts down the Serve
    applications it started."""
    ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install 'loramux[ray]')")
    # Replicas import loramux from this checkout; keep their torch threads to one each (2 cores here).
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1"}})
    try:
        yield ray
    finally:
        ray.shutdown()
