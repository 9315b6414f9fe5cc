"""One Settings object for the whole platform, read from `LORAMUX_*` environment variables."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_MODEL = "SmolLM2-135M-Instruct"


_METHOD = r"\s*(ngram|medusa|draft)\s*"
_METHODS_PATTERN = rf"^({_METHOD}(,{_METHOD})*)?$"  # LORAMUX_SPECULATIVE_METHODS: a comma-separated list


def _default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "loramux"


def _default_data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "loramux"


class Settings(BaseSettings):
    """Runtime configuration. Every field can be set as `LORAMUX_<FIELD>` (e.g. LORAMUX_DTYPE=bfloat16)."""

    model_config = SettingsConfigDict(env_prefix="LORAMUX_", extra="ignore")

    # Base model: the embedded default name, an HF directory of safetensors, or a .gguf file.
    model: str = DEFAULT_MODEL
    cache_dir: Path = Field(default_factory=_default_cache_dir)
    dtype: str = "auto"  # auto = float32 on CPU, bfloat16 on CUDA
    device: str = "auto"  # auto = cuda if available else cpu

    # Engine sizing.
    block_size: int = 16
    kv_cache_bytes: int = 512 * 1024**2  # memory budget for the paged KV pool
    max_num_seqs: int = 64  # most sequences in one batch
    max_num_batched_tokens: int = 512  # token cap of one step (prefill chunks are cut to fit)
    # How long a step carrying prefill work may take while streams decode; 0 = auto: twice the cost of the
    # step's decodes alone (a fitted cost model, seeded at start), so no prefill stalls the streams.
    step_target_ms: float = Field(default=0.0, ge=0)
    max_model_len: int = 4096
    priority_aging_s: float = 10.0  # queue aging: waiting this long is worth one tier of priority
    # Fair share within a tier (virtual token counters, loramux.engine.scheduling.fair_share): what a prompt token
    # and an
    # output token add to a tenant's counter, and each tier's weight (tokens count 1/weight; absent: 1).
    fair_share_input_weight: float = Field(default=1.0, gt=0)
    fair_share_output_weight: float = Field(default=2.0, gt=0)
    fair_share_tier_weights: dict[str, Annotated[float, Field(gt=0)]] = Field(default_factory=dict)
    prefix_caching: bool = True  # reuse the KV of shared prompt prefixes (never across adapter versions)
    prefix_cache_per_tenant: bool = True  # tenants never share cached blocks (no timing side channel)
    speculative_tokens: int = 4  # speculative decoding: draft length (0 = off)
    # Speculation is a cost decision per step (measured acceptance x the fitted step cost); this is a hard cap
    # on the decoding sequences above which it is not even considered.
    speculative_max_batch: int = 64
    # Proposers used when available (ngram, medusa, draft; order breaks ties).
    speculative_methods: str = Field(default="ngram,medusa,draft", pattern=_METHODS_PATTERN)
    speculative_adaptive: bool = True  # speculate only while measured acceptance x step cost says it pays
    # Medusa heads for the base model (a directory of `loramux medusa train`); "auto" = the heads shipped for
    # the embedded model when it is served, none otherwise; "" = none. Adapters' own heads come from the
    # registry (admin API /admin/medusa).
    medusa_heads: str = "auto"
    # Draft-model speculation (loramux.engine.speculation.draft_runner): a second resident model with the base's
    # tokenizer
    # that proposes tokens (the embedded name, an HF directory or a .gguf; `loramux draft distill` makes one
    # from the base's own first layers), and the memory budget of its own paged KV pool.
    draft_model: str | None = None
    draft_kv_cache_bytes: int = Field(default=64 * 1024**2, gt=0)

    # LoRA adapters: device memory for them (each at its own rank), the largest rank, an optional cap on
    # distinct adapters in one batch, and the residency policy (see loramux.adapters.residency.locations).
    adapter_pool_bytes: int = Field(default=0, ge=0)  # 0 = the same as kv_cache_bytes (`loramux plan` shows it)
    max_lora_rank: int = Field(default=128, ge=0)  # 0 disables LoRA
    max_loras: int = Field(default=0, ge=0)  # 0 = no cap
    adapter_min_residency_s: float = Field(default=2.0, ge=0)
    adapter_drain_after_s: float = Field(default=2.0, ge=0)
    lora_impl: Literal["auto", "triton", "torch"] = "auto"  # LoRA kernels: auto = Triton on CUDA, torch on CPU
    # Base weights: "int8" = int8 with per-channel scales (LM head included; adapters stay float), see
    # loramux.model.quantization.
    quantization: Literal["none", "int8"] = "none"
    cuda_graphs: bool = True  # decode steps replay CUDA graphs per batch-size bucket (CUDA only)
    # Adapter directories registered at start as public adapters of the tenant `local`: "name=dir,name2=dir2".
    adapters: str = ""

    def adapter_dirs(self) -> dict[str, str]:
        """Parse `adapters` into {name: directory}; raise ValueError naming the bad entry."""
        result = {}
        for entry in filter(None, (e.strip() for e in self.adapters.split(","))):
            name, sep, path = entry.partition("=")
            if not sep or not name.strip() or not path.strip():
                raise ValueError(f"LORAMUX_ADAPTERS entry {entry!r} must look like name=/path/to/adapter")
            result[name.strip()] = path.strip()
        return result

    # Registry and adapter storage. Defaults keep everything in `data_dir` (SQLite + a file store).
    data_dir: Path = Field(default_factory=_default_data_dir)
    database_url: str = ""  # "" = sqlite:///<data_dir>/loramux.db; else e.g. postgresql+psycopg://host/db
    store_url: str = ""  # "" = file://<data_dir>/blobs; or s3://bucket/prefix
    s3_endpoint_url: str | None = None  # MinIO / moto / other S3-compatible endpoints
    s3_region: str | None = None
    s3_access_key_id: str | None = None  # None: boto3's usual credential chain
    s3_secret_access_key: str | None = None
    s3_timeout_s: float = 10.0  # connect and read timeout of one S3 call
    s3_max_attempts: int = 3  # tries per S3 call (1 = no retry)
    disk_cache_bytes: int = 4 * 1024**3  # local disk cache of adapter blobs
    host_cache_bytes: int = 2 * 1024**3  # adapters, composites and Medusa heads in host RAM (unleased ones evicted LRU)
    max_upload_bytes: int = 512 * 1024**2  # largest adapter_model.safetensors accepted
    # Medusa heads (POST /admin/medusa) in host RAM, parsed: at most this much of host_cache_bytes, whose level
    # they share with adapters (LRU); their blobs share the disk cache above.
    medusa_cache_bytes: int = Field(default=1024**3, ge=0)
    # Longest a request waits for its Medusa heads to load into host RAM (within its deadline); it runs
    # without them past it, and the load goes on for the next request. 0: only heads already in RAM.
    medusa_load_wait_s: float = Field(default=2.0, ge=0)
    # Device memory for requests' own Medusa head sets (K x hidden² each), cached by digest (unused ones LRU). A
    # set that does not fit beside the sets in use is not loaded: its request runs without it (never refused).
    medusa_device_bytes: int = Field(default=512 * 1024**2, ge=0)
    # Largest embedding / head part of an upload (modules_to_save of lm_head / embed_tokens, trainable token
    # rows, embedding LoRA, PEFT's copy of the base embedding), in the file's bytes; 0 = none accepted.
    max_adapter_head_bytes: int = Field(default=256 * 1024**2, ge=0)
    # Largest JSON request body on every route but uploads (which max_upload_bytes caps): 413 above it,
    # refused from Content-Length at once or while a chunked body streams in.
    max_request_bytes: int = Field(default=4 * 1024**2, gt=0)
    # vLLM's adapter endpoints (POST /v1/load_lora_adapter, /v1/unload_lora_adapter; admin keys): `lora_path` is an
    # s3:// URL (read with the LORAMUX_S3_* settings) or a directory under one of these comma-separated absolute
    # roots ("" = no local directories), registered for the tenant the X-Loramux-Tenant header names, else this one.
    adapter_import_roots: str = ""
    adapter_import_tenant: str = ""
    # Resolver (vLLM's resolver plugins): a request whose `model` the registry does not know is looked up at
    # <adapter_resolver>/<tenant name>/<model>/ (s3://bucket/prefix/ or file:///dir/; "" = off), validated,
    # registered and served; a miss is remembered for `adapter_resolver_miss_ttl_s` (404s without a lookup).
    adapter_resolver: str = ""
    adapter_resolver_miss_ttl_s: float = Field(default=30.0, ge=0)

    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{Path(self.data_dir) / 'loramux.db'}"

    def resolved_store_url(self) -> str:
        return self.store_url or f"file://{Path(self.data_dir) / 'blobs'}"

    # Server.
    host: str = "127.0.0.1"
    port: int = 8000
    admin_key: str | None = None  # registered as an admin key at start (`loramux admin create-key` makes one)
    json_logs: bool = True  # one JSON object per log line (with the request id); false = plain text
    # Reverse proxies (addresses or CIDR networks, comma-separated) whose X-Forwarded-For / X-Forwarded-Proto
    # are believed: the client address (failed-authentication limit) and the scheme (Secure console cookies).
    trusted_proxies: str = ""
    # Failed authentications (unknown or revoked keys, console sign-ins) one client address may make per
    # minute before it gets 429 + Retry-After, valid key or not, until its minute ends (0 = no limit).
    auth_failures_per_min: int = Field(default=30, ge=0)
    # /metrics: "" = open (bind the server where only Prometheus reaches it); else a bearer token that
    # scrapes must send (Prometheus' `authorization: {credentials: ...}`), 401 without it.
    metrics_key: str = ""
    # A request whose reader (a streaming client) takes nothing for this long while output waits is
    # aborted: its KV blocks and adapter slot are freed, and its record says "cancelled".
    stalled_reader_timeout_s: float = Field(default=30.0, gt=0)
    # OpenAI API: the most choices one request may ask for on this server (`n`; 400 above it; each tier has
    # its own `max_choices` under this cap), and how long compiling a
    # structured-output constraint (a JSON schema, regex, tool-call schema) may take before the request is
    # refused with 400 (compiled off the event loop, cached by the engine).
    max_n: int = Field(default=16, ge=1, le=128)
    # Fan-out (`models`: one prompt to several adapters in one call): the most adapters one request may name on
    # this server, whatever its tier's `max_fanout` (400 above it).
    max_fanout: int = Field(default=16, ge=1, le=128)
    structured_compile_timeout_s: float = Field(default=10.0, gt=0)
    # Structured-output compiles run in worker processes (a pathological spec never stalls the engine),
    # killed past the timeout above: at most this many at once (a compile waits for a free worker at most
    # the timeout, then 503), each allowed this much address space beyond the worker's own (RLIMIT_AS; a
    # blow-up kills the worker, not the engine). Repetition bounds above `structured_max_repetition` (regex
    # {m,n}, a schema's minLength, maxLength, minItems, maxItems, minProperties, maxProperties) are a 400
    # before anything compiles.
    structured_compile_workers: int = Field(default=2, ge=1, le=64)
    structured_compile_memory_bytes: int = Field(default=2 * 1024**3, ge=64 * 1024**2)
    structured_max_repetition: int = Field(default=4096, ge=1)
    # Request shape limits, against hostile bodies: counted on the parsed JSON before any validator runs or
    # the rate limiter is asked, so a body of 100k tiny items is a 400 naming the field within milliseconds.
    # Then the most logprob entries one answer may hold (n x max_tokens x (top_logprobs + 1)): above it a 400
    # naming this setting, so no answer of hundreds of megabytes is built.
    max_messages: int = Field(default=2048, ge=1)  # `messages` of one chat request
    max_content_parts: int = Field(default=256, ge=1)  # content parts of one message
    max_stop_sequences: int = Field(default=16, ge=1)  # `stop` strings
    max_logit_bias_entries: int = Field(default=300, ge=0)  # `logit_bias` keys
    max_tools: int = Field(default=128, ge=0)  # `tools` of one request
    max_logprob_entries: int = Field(default=131_072, ge=1)  # about 8 MB of JSON
    # Weighted composition of adapters per request (`"adapters": [{"model", "weight"}, ...]`): the
    # most components one request may combine and the most summed rank (the sum of each component's largest
    # module rank; composites are served like adapters, so LORAMUX_MAX_LORA_RANK caps them too), 400 above
    # either. Built composites live in the host RAM cache (LORAMUX_HOST_CACHE_BYTES, with every adapter), built
    # on their own threads, at most so many builds in flight per tenant (the others wait within their deadline).
    composition_max_adapters: int = Field(default=4, ge=1, le=64)
    composition_max_rank: int = Field(default=128, ge=1)
    composition_build_threads: int = Field(default=1, ge=1, le=64)
    composition_builds_per_tenant: int = Field(default=2, ge=1)

    # Stored merges of adapters (POST /admin/adapters/merge): ties, dare_* and svd run in a worker
    # process, at most `merge_workers` at once (a merge waits for one at most `merge_timeout_s`, then 503), killed
    # past `merge_timeout_s` of wall time (its start, a few seconds of imports, included) and allowed
    # `merge_memory_bytes` beyond its own start (RLIMIT_AS). A merge whose estimated peak (svd: per module the
    # components' dense d_out x d_in deltas, three copies each in PEFT's sum, and the SVD) is above
    # `merge_memory_bytes` is refused before it starts (413 naming LORAMUX_MERGE_MEMORY_BYTES).
    merge_workers: int = Field(default=1, ge=1, le=16)
    merge_timeout_s: float = Field(default=600.0, gt=0)
    merge_memory_bytes: int = Field(default=4 * 1024**3, ge=128 * 1024**2)

    # Operator console (/console): the secret that signs its session cookies ("" = a random one per process,
    # so sessions end at a restart; set one shared by every ingress replica) and how long a session lasts.
    console_secret: str = ""
    console_session_s: int = Field(default=8 * 3600, gt=0)
    # Whether console cookies are `Secure`: "auto" = when the request came over HTTPS (as the server saw it,
    # or as a trusted proxy's X-Forwarded-Proto says), "always" (TLS ends at a proxy you do not list), "never".
    console_secure_cookies: Literal["auto", "always", "never"] = "auto"

    # Scale-out on Ray Serve (`loramux serve --ray`, see loramux.cluster): engine replicas, each its own
    # engine; adapters one replica keeps loaded for routing affinity (Serve's multiplexing LRU); torch threads
    # per replica (0 = torch's default); how often each replica publishes its state. Rate limits, concurrency
    # caps, replica state and adapter evictions are shared through Redis at `redis_url` (required with Ray).
    ray_replicas: int = Field(default=1, ge=1)
    ray_adapters_per_replica: int = Field(default=64, ge=1)
    ray_address: str = ""  # "" = start (or join) a local Ray cluster; else e.g. ray://head:10001
    cluster_threads_per_replica: int = Field(default=0, ge=0)
    cluster_snapshot_interval_s: float = Field(default=1.0, gt=0)
    redis_url: str = ""
    # Every Redis call (shared limits, replica state) times out after `redis_timeout_s`; after a failure Redis
    # is skipped for `redis_cooldown_s` (a circuit breaker). While it is unavailable, shared limits fail
    # "open" (requests are admitted, logged) or "closed" (503 with Retry-After).
    redis_timeout_s: float = Field(default=0.25, gt=0, le=10)
    redis_cooldown_s: float = Field(default=5.0, ge=0)
    shared_limits_fail_mode: Literal["open", "closed"] = "open"
    # Budgets (docs/admin-and-billing.md, "Budgets"): their reservations live in the database. While it cannot be
    # reached, a tenant with budgets is refused with 503 ("closed": money is never spent past a limit) or served
    # unreserved ("open").
    budget_fail_mode: Literal["open", "closed"] = "closed"
    # Alert webhooks (docs/admin-and-billing.md, "Alert webhooks"): how often the outbox is polled for events
    # due, each POST's timeout, the tries per event, and the backoff between tries (doubling from
    # `webhook_retry_initial_s`, at most `webhook_retry_max_s`).
    webhook_poll_s: float = Field(default=2.0, gt=0)
    webhook_timeout_s: float = Field(default=10.0, gt=0)
    webhook_max_attempts: int = Field(default=10, ge=1)
    webhook_retry_initial_s: float = Field(default=30.0, gt=0)
    webhook_retry_max_s: float = Field(default=3600.0, gt=0)
