"""`loramux` command line: generate, plan, serve, db."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from loramux.settings import DEFAULT_MODEL, Settings
from loramux.tenancy.cli import add_tenant_parsers
from loramux.training.draft_cli import add_draft_parser


class ConfigError(ValueError):
    """A setting that cannot work; the message names it and says what to fix."""


def settings_from_args(args) -> Settings:
    """The one Settings of a command: LORAMUX_* variables, overridden by --model/--dtype/--device/--quantization/
    --host/--port."""
    from pydantic import ValidationError

    overrides = {k: getattr(args, k, None) for k in ("model", "dtype", "device", "quantization", "host", "port")}
    try:
        return Settings(**{k: v for k, v in overrides.items() if v})
    except ValidationError as exc:
        first = exc.errors()[0]
        name = "LORAMUX_" + "_".join(str(p) for p in first["loc"]).upper()
        raise ConfigError(f"{name}: {first['msg']} (got {first.get('input')!r})") from None


def cmd_generate(args, settings: Settings) -> int:
    from loramux.adapters.formats.peft import AdapterFormatError
    from loramux.engine.engine import LLMEngine, RequestError
    from loramux.engine.sampling.params import SamplingParams

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature or 0.0,
                                top_p=args.top_p, top_k=args.top_k, seed=args.seed, stop=args.stop or [])
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    engine = LLMEngine.from_settings(settings)
    adapter = None
    if args.adapter:
        try:
            adapter = engine.load_adapter_dir(args.adapter, allow_base_mismatch=args.allow_base_mismatch).name
        except (AdapterFormatError, RequestError) as exc:
            print(f"error: adapter {args.adapter}: {exc}", file=sys.stderr)
            return 2
    load_s = time.perf_counter() - t0
    prompt = engine.encode_chat([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
    try:
        engine.add_request("cli", prompt, params, adapter=adapter)
    except RequestError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            sys.stdout.write(out.delta_text)
            sys.stdout.flush()
            if out.finished:
                final = out
    sys.stdout.write("\n")
    t = final.timings
    print(f"[{len(final.token_ids)} tokens, finish={final.finish_reason}, load {load_s:.1f}s, "
          f"ttft {t['ttft_ms']:.0f} ms, decode {t['decode_tokens_per_s'] or 0:.1f} tok/s, "
          f"total {t['total_ms']:.0f} ms]", file=sys.stderr)
    return 0


def cmd_plan(args, settings: Settings) -> int:
    from loramux.model.config import ModelConfig
    from loramux.model.loader import read_model_config, resolve_model_dir
    from loramux.plan import DTYPE_BYTES, fmt_bytes, kv_tokens_held, parse_bytes, plan_memory, weight_bytes

    if args.config:
        cfg = ModelConfig.from_hf(json.loads(Path(args.config).read_text()))
    else:
        cfg, _ = read_model_config(resolve_model_dir(settings.model, Path(settings.cache_dir)))
    dtype = args.dtype or "float32"
    if dtype not in DTYPE_BYTES:
        print(f"error: --dtype must be one of {', '.join(DTYPE_BYTES)}", file=sys.stderr)
        return 2
    try:
        pool = parse_bytes(args.adapter_pool) if args.adapter_pool else \
            settings.adapter_pool_bytes or settings.kv_cache_bytes
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    quantization = args.quantization or settings.quantization
    plan = plan_memory(cfg, DTYPE_BYTES[dtype], args.context_len, args.batch_size, pool, args.adapter_rank,
                       quantization, settings.block_size)
    plan.expert_lora = _expert_lora(cfg, args.expert_lora)
    draft_cfg = None
    if settings.draft_model:
        draft_cfg, _ = read_model_config(resolve_model_dir(settings.draft_model, Path(settings.cache_dir)))
        plan.draft_weights = weight_bytes(draft_cfg, DTYPE_BYTES[dtype], quantization)
        plan.draft_kv = settings.draft_kv_cache_bytes
    held = kv_tokens_held(cfg, args.context_len, settings.block_size)
    print(f"model: {cfg.model_type}, {cfg.num_parameters() / 1e6:.1f}M parameters, {cfg.num_layers} layers, "
          f"{cfg.num_kv_heads} KV heads x {cfg.head_dim}, dtype {dtype}"
          + (", int8 linear weights" if quantization == "int8" else ""))
    if cfg.moe is not None:
        print(_experts_line(cfg))
    print(f"weights        {fmt_bytes(plan.weights):>12}"
          + ("   (every expert; int8 leaves the experts in the model's dtype)" if cfg.moe is not None else ""))
    print(f"KV cache       {fmt_bytes(plan.kv_cache):>12}   ({fmt_bytes(plan.kv_per_token)}/token x "
          f"{held} tokens x {args.batch_size} sequences)")
    _print_layer_kinds(cfg, plan, args, held)
    print(f"adapter pool   {fmt_bytes(plan.adapter_pool):>12}   ({plan.adapters_fit} adapters of rank "
          f"{args.adapter_rank} on {_adapter_targets(cfg, plan.expert_lora)} at {fmt_bytes(plan.slot_bytes)} each; "
          "each adapter takes its own rank's share; LORAMUX_ADAPTER_POOL_BYTES, default LORAMUX_KV_CACHE_BYTES)")
    if cfg.moe is not None:
        print(f"               expert LoRA (PEFT target_parameters on the experts' gate_up_proj and down_proj) adds "
              f"{fmt_bytes(plan.expert_lora_bytes)} to an adapter of rank {args.adapter_rank}: rank x (in + out) "
              f"per expert projection, x {cfg.moe.num_experts} experts x {cfg.moe.num_sparse_layers} layers"
              + ("" if plan.expert_lora else "; --expert-lora counts it in each adapter"))
    print(f"               an adapter with a trained lm_head or embed_tokens (modules_to_save) holds "
          f"{fmt_bytes(plan.head_bytes)} more per head; trainable tokens and an embedding LoRA cost only their "
          "rows")
    print(f"speculation    Medusa heads: {fmt_bytes(plan.medusa_bytes)} per set of 3 (the base model's, and each "
          "adapter version's while its requests run)")
    if draft_cfg is not None:
        print(f"draft model    {fmt_bytes(plan.draft_weights + plan.draft_kv):>12}   ({draft_cfg.num_layers} layers: "
              f"weights {fmt_bytes(plan.draft_weights)} + its own KV pool {fmt_bytes(plan.draft_kv)}, "
              "LORAMUX_DRAFT_KV_CACHE_BYTES)")
    print(f"total          {fmt_bytes(plan.total):>12}")
    if args.memory:
        try:
            budget = parse_bytes(args.memory)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        verdict = "fits" if plan.total <= budget else "does NOT fit"
        print(f"{verdict} in {fmt_bytes(budget)} ({fmt_bytes(budget - plan.total)} left)")
        return 0 if plan.total <= budget else 1
    return 0


def _print_layer_kinds(cfg, plan, args, held: int) -> None:
    """What windowed and linear-attention layers change about the KV a sequence holds."""
    if cfg.linear_attention is not None:
        print(_hybrid_lines(cfg, plan, args.batch_size, args.context_len))
    local = sum(w is not None for w in cfg.layer_windows)
    if cfg.sliding_window is not None:
        print(f"               sliding window of {cfg.sliding_window} on every layer: a sequence holds at most "
              f"{held} tokens of KV, whatever its context")
    elif local:
        print(f"               {local} of {cfg.num_layers} layers are local (window "
              f"{max(w for w in cfg.layer_windows if w)}): they attend less, but the cache holds every layer "
              "at every token")


def _hybrid_lines(cfg, plan, batch_size: int, context_len: int) -> str:
    """`loramux plan`'s account of a hybrid base: which layers hold KV, and the fixed-size state of the others."""
    from loramux.plan import fmt_bytes as fmt_size

    linear = cfg.linear_attention
    kv_context = plan.kv_per_token * context_len
    return (f"               {len(cfg.attention_layers)} of {cfg.num_layers} layers are full attention (the KV "
            f"above); the {linear.num_linear_layers} Gated DeltaNet layers hold a fixed state instead\n"
            f"linear state   {fmt_size(plan.state_pool):>12}   ({fmt_size(plan.state_per_sequence)}/sequence x "
            f"{batch_size} sequences, whatever the context; at {context_len} tokens a sequence's KV is "
            f"{fmt_size(kv_context)}; taken from LORAMUX_KV_CACHE_BYTES, at most half of it)")


def _expert_lora(cfg, wanted: bool) -> bool:
    if wanted and cfg.moe is None:
        raise ConfigError(f"--expert-lora needs a mixture-of-experts base; {cfg.model_type} has no routed experts")
    return wanted


def _experts_line(cfg) -> str:
    """`loramux plan`'s summary of a mixture-of-experts base: experts, top-k, sparse layers, total and active
    parameters."""
    moe = cfg.moe
    shared = f", plus a shared expert of width {moe.shared_expert_size}" if moe.shared_expert_size else ""
    return (f"experts        {moe.num_experts} routed experts of width {moe.intermediate_size}, top-{moe.top_k}, "
            f"in {moe.num_sparse_layers} of {cfg.num_layers} layers{shared}: {cfg.num_parameters() / 1e9:.2f}B "
            f"parameters, {cfg.active_parameters() / 1e9:.2f}B active per token")


def _adapter_targets(cfg, expert_lora: bool) -> str:
    """What a planned adapter covers: every projection of a dense model; attention (and the dense layers' MLP)
    of a mixture-of-experts one, whose sparse layers have no dense MLP, plus the experts with --expert-lora."""
    if cfg.linear_attention is not None and cfg.moe is None:
        return "attention, the linear-attention projections and the MLP"
    if cfg.moe is None:
        return "all 7 projections"
    dense = cfg.num_layers - cfg.moe.num_sparse_layers
    return ("attention" + (f" and the MLP of the {dense} dense layers" if dense else "")
            + (" and the routed experts" if expert_lora else ""))


def cmd_serve(args, settings: Settings) -> int:
    import uvicorn

    from loramux.model.loader import read_model_config, resolve_model_dir
    from loramux.server.app import create_app
    from loramux.server.http.logs import configure_logging
    from loramux.services.container import Services
    from loramux.tenancy.admin_keys import AdminKeyFormatError, check_admin_key_format

    # Configuration that cannot work fails here, in one line, before the server starts.
    settings.adapter_dirs()
    if settings.admin_key:
        try:
            check_admin_key_format(settings.admin_key)
        except AdminKeyFormatError as exc:
            raise ConfigError(str(exc)) from None
    read_model_config(resolve_model_dir(settings.model, Path(settings.cache_dir)))
    host, port = settings.host, settings.port
    configure_logging(json_logs=settings.json_logs)
    if getattr(args, "ray", False):
        return serve_on_ray(args, settings)

    def services():
        built = Services.from_settings(settings)
        print(first_steps(built, f"http://{host}:{port}"), file=sys.stderr, flush=True)
        return built

    uvicorn.run(create_app(services), host=host, port=port, log_config=None)
    return 0


def serve_on_ray(args, settings: Settings) -> int:
    """`loramux serve --ray`: the ingress and `--replicas` engine replicas on Ray Serve (see loramux.cluster)."""
    try:
        from loramux.cluster import app as cluster_app
    except ImportError as exc:
        raise ConfigError(f"--ray needs the ray extra: pip install 'loramux[ray]' ({exc})") from None
    if args.replicas:
        settings = settings.model_copy(update={"ray_replicas": args.replicas})
    if not settings.redis_url:
        raise ConfigError("--ray needs LORAMUX_REDIS_URL (e.g. redis://127.0.0.1:6379/0): replicas share rate "
                          "limits and state through Redis")
    print(f"loramux on Ray Serve: {settings.ray_replicas} engine replica(s), http://{settings.host}:{settings.port}",
          file=sys.stderr, flush=True)
    cluster_app.run(settings, blocking=True)
    return 0


DEMO_TENANT = "demo"


def first_steps(services, url: str) -> str:
    """What to do next, printed at start. The demo tenant's first key is shown here once; later starts
    say how to make another."""
    _, created = services.tenancy.ensure_tenant(DEMO_TENANT, tier="standard")
    key = services.tenancy.create_key(DEMO_TENANT)[1] if created else None
    admin_key = None
    if not services.settings.admin_key and not services.admin_keys.list():
        admin_key = services.admin_keys.create("first start")[1]
    model = services.settings.model
    lines = ["", "=" * 78, f"loramux is serving {model} on {url}"]
    if admin_key:
        lines += ["An admin key was created for /admin and `loramux admin ...` (shown only this once):", "",
                  f"  export LORAMUX_ADMIN_KEY={admin_key}", ""]
    else:
        lines += ["Admin: a new admin key comes from `.venv/bin/loramux admin create-key`.", ""]
    if key:
        lines += ["A demo tenant was created. Its API key (shown only this once):", "",
                  f"  export LORAMUX_KEY={key}", ""]
    else:
        lines += ["Get an API key for the demo tenant (or any tenant: `loramux tenants create NAME`):", "",
                  "  export LORAMUX_KEY=$(.venv/bin/loramux keys create demo)", ""]
    lines += [
        "Then:",
        f"  curl -s {url}/v1/chat/completions -H \"Authorization: Bearer $LORAMUX_KEY\" \\",
        "    -H 'Content-Type: application/json' \\",
        f"    -d '{{\"model\": \"{model}\", \"temperature\": 0, \"max_tokens\": 64, "
        "\"messages\": [{\"role\": \"user\", \"content\": \"What is the capital of France?\"}]}'",
        "",
        "  OPENAI_API_KEY=$LORAMUX_KEY .venv/bin/python -c \"import openai; c = openai.OpenAI(base_url='" + url
        + "/v1'); print(c.chat.completions.create(model='" + model + "', "
        "temperature=0, max_tokens=64, messages=[{'role': 'user', 'content': 'What is the capital of France?'}])"
        ".choices[0].message.content)\"",
        "=" * 78, ""]
    return "\n".join(lines)


def cmd_db(args, settings: Settings) -> int:
    from loramux.db import Database

    db = Database(args.url or settings.resolved_database_url())
    try:
        if args.db_command == "upgrade":
            db.upgrade(args.revision)
            print(f"database at revision {db.current_revision()}")
        elif args.db_command == "downgrade":
            db.downgrade(args.revision)
            print(f"database at revision {db.current_revision() or 'base (empty)'}")
        elif args.db_command == "gc":
            return _collect_garbage(db, settings)
        else:
            print(db.current_revision() or "base (no migrations applied)")
    finally:
        db.dispose()
    return 0


def _collect_garbage(db, settings: Settings) -> int:
    """Delete adapter blobs in the object store that no live version references, and Medusa heads blobs
    that no live heads reference (retiring the heads of deleted adapter versions first)."""
    from loramux.adapters.storage.medusa_registry import collect_medusa_garbage
    from loramux.adapters.storage.registry import collect_garbage
    from loramux.services.builder import store_from_settings

    store = store_from_settings(settings)
    removed = collect_garbage(db, store) + collect_medusa_garbage(db, store)
    for key in removed:
        print(f"deleted {key}")
    print(f"{len(removed)} unreferenced blob(s) deleted", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="loramux", description="Multi-tenant LoRA serving on one base model.")
    sub = ap.add_subparsers(dest="command", required=True)

    def model_opts(p):
        p.add_argument("--model", help=f"base model: {DEFAULT_MODEL} (default), a .gguf file or an HF directory")
        p.add_argument("--dtype", help="auto (default), float32, bfloat16, float16")
        p.add_argument("--device", help="auto (default), cpu, cuda")
        p.add_argument("--quantization", choices=("none", "int8"),
                       help="base weights: none (default) or int8 (per-channel scales; LORAMUX_QUANTIZATION)")

    g = sub.add_parser("generate", help="generate text for one prompt (greedy unless --temperature)")
    model_opts(g)
    g.add_argument("prompt")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--adapter", help="a PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors)")
    g.add_argument("--allow-base-mismatch", action="store_true",
                   help="accept an adapter whose base_model_name_or_path names another model (shapes are checked)")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=None)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.set_defaults(func=cmd_generate)

    p = sub.add_parser("plan", help="memory needed for weights, KV cache and adapter slots")
    model_opts(p)
    p.add_argument("--config", help="an HF config.json to plan for instead of --model")
    p.add_argument("--context-len", type=int, default=4096)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--adapter-pool", help="adapter pool size, e.g. 2GiB (default: the configured pool)")
    p.add_argument("--adapter-rank", type=int, default=16)
    p.add_argument("--expert-lora", action="store_true",
                   help="mixture-of-experts base: plan adapters that also carry LoRA on the routed experts "
                        "(PEFT target_parameters), at --adapter-rank")
    p.add_argument("--memory", help="memory to fit in, e.g. 24GiB or 80GB")
    p.set_defaults(func=cmd_plan)

    s = sub.add_parser("serve", help="start the HTTP server")
    model_opts(s)
    s.add_argument("--host")
    s.add_argument("--port", type=int)
    s.add_argument("--ray", action="store_true", help="serve on Ray Serve: an ingress and engine replicas "
                                                       "(needs the ray extra and LORAMUX_REDIS_URL)")
    s.add_argument("--replicas", type=int, help="engine replicas with --ray (LORAMUX_RAY_REPLICAS; default 1)")
    s.set_defaults(func=cmd_serve)

    d = sub.add_parser("db", help="database migrations (LORAMUX_DATABASE_URL; default SQLite in the data dir)")
    dsub = d.add_subparsers(dest="db_command", required=True)
    up = dsub.add_parser("upgrade", help="apply migrations (default: all)")
    up.add_argument("revision", nargs="?", default="head")
    down = dsub.add_parser("downgrade", help="revert migrations (default: all)")
    down.add_argument("revision", nargs="?", default="base")
    dsub.add_parser("current", help="print the applied revision")
    dsub.add_parser("gc", help="delete adapter blobs that no live version references (LORAMUX_STORE_URL)")
    for p in (up, down, *dsub.choices.values()):
        if not any(a.dest == "url" for a in p._actions):
            p.add_argument("--url", help="database URL instead of LORAMUX_DATABASE_URL")
    d.set_defaults(func=cmd_db)

    add_tenant_parsers(sub)
    add_draft_parser(sub)

    from loramux.training.medusa_cli import add_medusa_parser

    add_medusa_parser(sub, model_opts)

    from loramux.admin.cli import add_parser as add_admin_parser

    add_admin_parser(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    from loramux.server.http.logs import configure_logging

    configure_logging(json_logs=False)  # `serve` switches to JSON lines (LORAMUX_JSON_LOGS)
    args = build_parser().parse_args(argv)
    from loramux.model.config import UnsupportedModelError
    from loramux.model.loader import ModelNotFoundError

    try:
        return args.func(args, settings_from_args(args))
    except (ModelNotFoundError, UnsupportedModelError, ValueError) as exc:  # ConfigError is a ValueError
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
