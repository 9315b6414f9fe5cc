"""Hybrid linear attention at Qwen3.5-0.8B's shapes: decode against a dense model of the same size, and mixed LoRA.

The hybrid: random weights of Qwen3.5-0.8B's language model (model_type qwen3_5_text; its config.json's
text_config: hidden 1024, 24 layers as 6 x (3 Gated DeltaNet + 1 gated full attention), 8 heads / 2 KV heads of 256
with the q_proj output gate, q/k norms, partial rotary 0.25, rope_theta 1e7; linear attention with 16 key and 16
value heads of 128, conv kernel 4; intermediate 3584; tied embeddings), with a vocabulary of 1024 (--vocab) instead
of 248320 so that the embedding and the LM head are negligible and the figures measure the layer stack. The text
RoPE is plain (the checkpoint's mrope sections only matter for image tokens). The dense model: model_type qwen3 at
the same width and depth (hidden 1024, 24 layers, 8 / 2 heads of 256, intermediate 3584, vocab 1024, tied), every
layer full attention. Configs come from transformers' own classes (`AutoConfig.for_model`), the weights from
bench/model_families.py's `build_checkpoint` (float32 safetensors, matrices ~ N(0, 0.02^2), vectors 1, SmolLM2's
tokenizer beside them), once, into ~/.cache/loramux-bench/models/ (--models-dir).

Workload: batch 8, prompts of 16 random token ids, exactly --new-tokens (64) new tokens per request, greedy, EOS
ignored, loramux's LLMEngine in this process (prefix caching and speculation off, adapters loaded inline), in
bfloat16 when the CPU has native bf16 (avx512_bf16 or amx_bf16) else float32 (--dtype), --threads (2) threads pinned
to as many cores. Each configuration is warmed up once; then --rounds (5) rounds alternate the order. Figures are
medians of decode-only tok/s: the batch's tokens after each row's first / the time from the step that gave every row
its first token to the end (the prefill left out; the tok/s with it is printed beside).

* `hybrid_decode_vs_dense`: the hybrid's decode tok/s / the dense model's, no adapter, the same engine settings.
  Printed beside it, the ratio of bytes a decode step moves at least, dense / hybrid: every parameter once, each
  row's linear-attention state read and written once, each row's KV at the mean context read once.
* `hybrid_mixed_vs_base`: the hybrid with 8 distinct random PEFT LoRA adapters (r=16, lora_alpha 32, one per row) /
  the same batch with no adapter (target >= 0.7). The adapters target --targets, groups of projections: attention
  (q_proj, k_proj, v_proj, o_proj on the full-attention layers), mlp (gate_proj, up_proj, down_proj) and linear
  (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj on the Gated DeltaNet layers); default all three. Each
  group is first tried alone through loramux's adapter validation: a group it refuses is left out, its refusal
  printed (a REFUSED line) and a NOTE line before the FIGURE lines says which targets the figure covers; if every
  group is refused the figure is `n/a`. The ceiling from bytes moved is printed beside it: what a decode step moves
  at least (as in the first figure) against what the adapters add (each row its own adapter, whole).

Also printed: the per-sequence state (`ModelConfig.state_bytes_per_sequence`: conv windows in the run's dtype,
recurrent matrices in float32) beside the KV cache of a 4096-token context (`kv_bytes_per_token` x 4096) for the
hybrid and the dense model.

`--smoke` (what tests/system/test_hybrid_bench.py runs): `--tiny` (toy shapes of both families: hidden 64, 4
layers, in a temporary directory), 4 new tokens, one round; the same code paths and FIGURE lines in seconds,
figures meaningless. A full run takes ~2 min on a quiet machine once the checkpoints (2 GB and 1.6 GB in float32)
are written (~25 s, once; the adapters are written afresh each run, into a temporary directory); run it on a quiet
machine, or at `nice -n -15`. Where another job takes a core, two threads lose 5-30x at random (each step waits for
the descheduled one) and the rounds scatter; `--threads 1` stays within a few percent there.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from model_families import build_checkpoint
from moe import Side, log, loramux_generate, pin_threads

MODELS_DIR = Path.home() / ".cache" / "loramux-bench" / "models"
RANK, ALPHA = 16, 32
PROMPT_LEN = 16
MAX_MODEL_LEN = 256  # prompts and outputs stay far below
CONTEXT = 4096  # the context the KV-vs-state comparison is printed at
T0 = time.perf_counter()

# Qwen3.5-0.8B's text_config (Hub config.json), as transformers' Qwen3_5TextConfig takes it; vocab and depth are
# the bench's (--vocab, --layers). layer_types follows from full_attention_interval 4: every 4th layer attends.
QWEN3_5_0P8B = dict(
    hidden_size=1024, intermediate_size=3584, num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2,
    head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4, attention_bias=False,
    rms_norm_eps=1e-6, max_position_embeddings=262144, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25})
# --tiny (and --smoke): the same family at toy sizes.
TINY = dict(QWEN3_5_0P8B, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=8, linear_value_head_dim=8, max_position_embeddings=2048)
HYBRID_ONLY = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
               "linear_conv_kernel_dim", "full_attention_interval", "rope_parameters")
TARGET_GROUPS = {
    "attention": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "mlp": ["gate_proj", "up_proj", "down_proj"],
    "linear": ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"],
}


def dense_kwargs(hybrid: dict) -> dict:
    """A qwen3 (every layer full attention) config of the hybrid's width, depth, heads and vocabulary."""
    kwargs = {k: v for k, v in hybrid.items() if k not in HYBRID_ONLY}
    kwargs["rope_parameters"] = {"rope_type": "default", "rope_theta": hybrid["rope_parameters"]["rope_theta"]}
    return kwargs


def native_bf16() -> bool:
    """Whether the CPU multiplies bfloat16 natively (AVX512-BF16 or AMX): bf16 is then the faster dtype."""
    from loramux.testing import cpu_info

    return bool({"avx512_bf16", "amx_bf16"} & set(cpu_info().flags.split()))


# --- checkpoints and adapters ------------------------------------------------------------------------------


def prepare_models(args) -> tuple[Path, Path]:
    """The hybrid's and the dense model's checkpoint directories (written once)."""
    import atexit
    import shutil
    import tempfile

    from loramux.model.loader import resolve_model_dir
    from loramux.settings import Settings

    tokenizer_dir = resolve_model_dir("SmolLM2-135M-Instruct", Path(Settings().cache_dir))
    if args.tiny:
        root = Path(tempfile.mkdtemp(prefix="loramux-hybrid-smoke-"))
        atexit.register(shutil.rmtree, root, ignore_errors=True)
        hybrid = dict(TINY, vocab_size=args.vocab)
        names = ("qwen3_5-tiny", "qwen3-tiny")
    else:
        root = args.models_dir
        hybrid = dict(QWEN3_5_0P8B, num_hidden_layers=args.layers, vocab_size=args.vocab)
        stem = f"qwen3_5_0p8b-{args.layers}l-v{args.vocab}"
        names = (stem, f"qwen3_dense_like_{stem}")
    dirs = []
    for name, model_type, kwargs in zip(names, ("qwen3_5_text", "qwen3"), (hybrid, dense_kwargs(hybrid))):
        log(f"checkpoint {root / name}")
        dirs.append(build_checkpoint(root / name, model_type, kwargs, tokenizer_dir))
    return dirs[0], dirs[1]


def write_adapter(path: Path, cfg, targets: list[str], seed: int, dtype: str) -> Path:
    """A random PEFT LoRA (r=RANK, lora_alpha=ALPHA, B ~ N(0, 0.02^2)) on `targets` of the model config `cfg`, as
    `loramux.testing.write_peft_adapter` writes it (each hybrid layer gets the targets of its kind). Written afresh
    every run (seconds), so that its shapes are always the ones this tree's validation expects. KeyError: loramux
    knows no shape for a target."""
    from loramux.testing import write_peft_adapter

    return write_peft_adapter(path, cfg, RANK, targets, seed=seed, alpha=ALPHA, b_std=0.02, dtype=dtype)


def accepted_groups(groups: list[str], cfg, dtype: str, root: Path) -> tuple[list[str], dict[str, str]]:
    """Which target groups loramux's adapter validation takes on this base, each tried alone on a probe adapter
    written under `root`; and, per refused group, why."""
    from loramux.adapters.formats.peft import load_adapter_dir
    from loramux.adapters.formats.validation import AdapterValidationError

    ok, refused = [], {}
    for group in groups:
        try:
            path = write_adapter(root / f"probe-{group}", cfg, TARGET_GROUPS[group], seed=0, dtype=dtype)
            load_adapter_dir(path, cfg, f"probe-{group}", RANK)
        except KeyError as exc:
            refused[group] = (f"loramux's adapter validation knows no shape for {exc.args[0]!r} "
                              "(adapters.formats.validation.projection_shapes): no LoRA on it in this tree")
        except AdapterValidationError as exc:
            refused[group] = f"{exc.code}: {exc}"
        else:
            ok.append(group)
    return ok, refused


# --- loramux -----------------------------------------------------------------------------------------------


def make_engine(model_dir: Path, dtype: str, batch: int, pool_bytes: int):
    """The engine both models run on: state slots for every row of a hybrid, KV for every row's whole context,
    an adapter pool of `pool_bytes`; prefix caching and speculation off, prefill in one step."""
    import torch
    from transformers import AutoTokenizer

    from loramux.engine.config import EngineConfig
    from loramux.engine.engine import LLMEngine
    from loramux.model.loader import build_model

    torch_dtype = getattr(torch, dtype)
    model, cfg = build_model(model_dir, torch_dtype, torch.device("cpu"), max_positions=MAX_MODEL_LEN)
    elem = torch.finfo(torch_dtype).bits // 8
    # The engine gives state slots at most half of kv_cache_bytes: twice the rows' state, plus their KV.
    kv_bytes = 2 * batch * cfg.state_bytes_per_sequence(elem) + batch * MAX_MODEL_LEN * cfg.kv_bytes_per_token(elem)
    config = EngineConfig(max_num_seqs=batch, max_num_batched_tokens=max(512, batch * PROMPT_LEN),
                          max_model_len=MAX_MODEL_LEN, kv_cache_bytes=kv_bytes + 16 * 2**20, max_lora_rank=RANK,
                          adapter_pool_bytes=pool_bytes, async_adapter_loads=False, prefix_caching=False,
                          speculative_tokens=0, step_target_ms=None)
    engine = LLMEngine(model, AutoTokenizer.from_pretrained(model_dir), config, (), torch_dtype, torch.device("cpu"))
    return engine, cfg


def step_bytes(cfg, elem: int, batch: int, context: int) -> tuple[int, int, int]:
    """(weights, state, KV) bytes a decode step of `batch` rows at `context` tokens moves at least: every parameter
    once (the embedding rows it reads are negligible at the bench's vocabulary), each row's linear-attention state read
    and written once, each row's KV read once."""
    return (cfg.num_parameters() * elem, 2 * batch * cfg.state_bytes_per_sequence(elem),
            batch * context * cfg.kv_bytes_per_token(elem))


def memory_lines(cfgs: dict, dtype: str, elem: int) -> list[str]:
    """Per-sequence state and the KV of a CONTEXT-token context, per model."""
    lines = [f"\nper-sequence memory ({dtype}; state: conv windows in {dtype}, recurrent matrices in float32):",
             f"{'model':10s}{'KV layers':>10s}{'state bytes':>14s}{f'KV bytes at {CONTEXT}':>18s}{'total':>14s}"]
    for name, cfg in cfgs.items():
        state, kv = cfg.state_bytes_per_sequence(elem), cfg.kv_bytes_per_token(elem) * CONTEXT
        lines.append(f"{name:10s}{len(cfg.attention_layers):10d}{state:14,d}{kv:18,d}{state + kv:14,d}"
                     f"   ({(state + kv) / 2**20:.1f} MiB)")
    return lines


# --- main --------------------------------------------------------------------------------------------------


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true",
                    help="smoke run (what the tests run): toy shapes, 4 new tokens, one round; seconds")
    ap.add_argument("--tiny", action="store_true", help="the toy shapes of --smoke, with everything else as asked")
    ap.add_argument("--targets", default="all",
                    help=f"adapter target groups, comma-separated, of {', '.join(TARGET_GROUPS)} (default all)")
    ap.add_argument("--layers", type=int, default=24, help="decoder layers (default 24, the real depth)")
    ap.add_argument("--vocab", type=int, default=1024, help="vocabulary size (default 1024)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                    help="weights and activations (default: bfloat16 on a CPU with native bf16, else float32)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds (default 5; --smoke 1)")
    ap.add_argument("--new-tokens", type=int, default=None, help="tokens per request (default 64; --smoke 4)")
    ap.add_argument("--warmup-tokens", type=int, default=None, help="tokens per request of the warm-up (default 8)")
    ap.add_argument("--threads", type=int, default=2, help="threads (and cores) (default 2)")
    ap.add_argument("--models-dir", type=Path, default=MODELS_DIR, help="where the checkpoints and adapters are kept")
    args = ap.parse_args(argv)
    args.tiny = args.tiny or args.smoke
    args.rounds = args.rounds or (1 if args.smoke else 5)
    args.new_tokens = args.new_tokens or (4 if args.smoke else 64)
    args.warmup_tokens = min(args.warmup_tokens or (2 if args.smoke else 8), args.new_tokens)
    groups = list(TARGET_GROUPS) if args.targets == "all" else [g for g in args.targets.split(",") if g]
    unknown = sorted(set(groups) - set(TARGET_GROUPS))
    if unknown or not groups:
        ap.error(f"--targets: unknown groups {unknown}; choose from {', '.join(TARGET_GROUPS)} or all")
    args.groups = list(dict.fromkeys(groups))
    if args.dtype == "auto":
        args.dtype = "bfloat16" if native_bf16() else "float32"
    return args


def run(args, cpus: list[int]) -> int:  # noqa: C901 - one linear script: build, warm up, rounds, report
    import atexit
    import shutil
    import tempfile

    import torch

    from loramux.model.loader import read_model_config
    from loramux.testing import describe_cpu

    hybrid_dir, dense_dir = prepare_models(args)
    hybrid_cfg, _ = read_model_config(hybrid_dir)
    adapters_dir = Path(tempfile.mkdtemp(prefix="loramux-hybrid-adapters-"))
    atexit.register(shutil.rmtree, adapters_dir, ignore_errors=True)
    groups, refused = accepted_groups(args.groups, hybrid_cfg, args.dtype, adapters_dir)
    for group, why in refused.items():
        log(f"REFUSED target group {group} ({', '.join(TARGET_GROUPS[group])}): {why}")
    targets = [t for g in groups for t in TARGET_GROUPS[g]]
    paths: list[Path] = []
    if targets:
        paths = [write_adapter(adapters_dir / f"adapter-{i}", hybrid_cfg, targets,
                               seed=100 + i, dtype=args.dtype) for i in range(args.batch)]
        log(f"{len(paths)} adapters on {', '.join(targets)} in {adapters_dir}")
    adapter_bytes = [(p / "adapter_model.safetensors").stat().st_size for p in paths]

    log("building the engines")
    # Room for every adapter at once, plus a quarter for the pool's own rounding.
    hybrid, hybrid_cfg = make_engine(hybrid_dir, args.dtype, args.batch, int(1.25 * sum(adapter_bytes)) + 64 * 2**20)
    dense, dense_cfg = make_engine(dense_dir, args.dtype, args.batch, 64 * 2**20)
    names = [f"hybrid-{i}" for i in range(len(paths))]
    for name, path in zip(names, paths):
        hybrid.load_adapter_dir(path, name)
    log(f"engines up: hybrid {hybrid.num_state_slots} state slots, {len(names)} adapters loaded")

    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, args.vocab, (PROMPT_LEN,), generator=g).tolist() for _ in range(args.batch)]
    sides = {"dense": Side("dense qwen3 base"), "base": Side("hybrid base")}
    runs = {"dense": (dense, [None] * args.batch), "base": (hybrid, [None] * args.batch)}
    if names:
        sides["mixed"] = Side(f"hybrid {len(names)} adapters")
        runs["mixed"] = (hybrid, names)

    def once(key: str, new_tokens: int):
        engine, rows = runs[key]
        elapsed, decode, out = loramux_generate(engine, prompts, rows, new_tokens)
        counts = [len(o) for o in out]
        if counts != [new_tokens] * args.batch:
            raise RuntimeError(f"{key}: requests produced {counts} tokens, expected {new_tokens} each")
        dec = args.batch * (new_tokens - 1) / decode if decode > 0 else float("nan")
        return args.batch * new_tokens / elapsed, dec, out

    for key, side in sides.items():
        tok_s, dec, _ = once(key, args.warmup_tokens)
        log(f"warm-up {side.name:20s} {tok_s:8.2f} tok/s (decode only {dec:.2f})")
    order = list(sides)
    for r in range(args.rounds):
        for key in (order if r % 2 == 0 else order[::-1]):
            tok_s, dec, out = once(key, args.new_tokens)
            side = sides[key]
            side.tok_s.append(tok_s)
            side.decode_tok_s.append(dec)
            if r == 0:
                side.ids = out
            log(f"round {r + 1}/{args.rounds} {side.name:20s} decode only {dec:8.2f} tok/s ({tok_s:.2f} with prefill)")

    # --- report ---
    elem = torch.finfo(getattr(torch, args.dtype)).bits // 8
    la = hybrid_cfg.linear_attention
    assert la is not None
    shapes = ("toy shapes (--tiny)" if args.tiny else "Qwen3.5-0.8B's text config (Hub config.json)")
    print(f"\nhybrid: qwen3_5_text at {shapes}: hidden {hybrid_cfg.hidden_size}, {hybrid_cfg.num_layers} layers "
          f"({la.num_linear_layers} Gated DeltaNet + {len(hybrid_cfg.attention_layers)} gated full attention), "
          f"{hybrid_cfg.num_heads} heads / {hybrid_cfg.num_kv_heads} KV heads x {hybrid_cfg.head_dim}, linear "
          f"{la.num_key_heads} key / {la.num_value_heads} value heads x {la.key_head_dim} / {la.value_head_dim}, "
          f"conv {la.conv_kernel}, intermediate {hybrid_cfg.intermediate_size}, vocab {hybrid_cfg.vocab_size} "
          f"(the real 248320 shrunk: the layer stack dominates); {hybrid_cfg.num_parameters() / 1e6:.1f} M parameters")
    print(f"dense: qwen3, hidden {dense_cfg.hidden_size}, {dense_cfg.num_layers} full-attention layers, "
          f"{dense_cfg.num_heads} / {dense_cfg.num_kv_heads} heads x {dense_cfg.head_dim}, intermediate "
          f"{dense_cfg.intermediate_size}, vocab {dense_cfg.vocab_size}; {dense_cfg.num_parameters() / 1e6:.1f} M "
          f"parameters")
    print(f"{args.dtype}; batch {args.batch}, {PROMPT_LEN}-token prompts, {args.new_tokens} new tokens (EOS ignored), "
          f"{args.rounds} round(s) after one warm-up; {time.strftime('%Y-%m-%d %H:%M')} UTC")
    print(f"{'configuration':24s}{'decode tok/s (median)':>23s}{'with prefill':>14s}   decode tok/s per round")
    med = {}
    for key, side in sides.items():
        med[key] = statistics.median(side.decode_tok_s)
        print(f"{side.name:24s}{med[key]:23.2f}{statistics.median(side.tok_s):14.2f}   "
              f"{[round(v, 2) for v in side.decode_tok_s]}")
    for line in memory_lines({"hybrid": hybrid_cfg, "dense": dense_cfg}, args.dtype, elem):
        print(line)

    decode_ratio = med["base"] / med["dense"]
    context = PROMPT_LEN + args.new_tokens // 2
    moved = {name: step_bytes(cfg, elem, args.batch, context) for name, cfg in (("hybrid", hybrid_cfg),
                                                                                 ("dense", dense_cfg))}
    expected = sum(moved["dense"]) / sum(moved["hybrid"])
    print(f"\nbytes a decode step moves at least (weights once + state read and written once + KV at the mean "
          f"context of {context} tokens): " + ", ".join(
              f"{name} {' + '.join(f'{b / 2**20:.1f}' for b in parts)} MiB" for name, parts in moved.items())
          + f" -> dense / hybrid = {expected:.3f}; measured hybrid / dense decode {decode_ratio:.3f}")
    mixed_ratio = None
    if "mixed" in sides:
        base_b, lora_b = sum(moved["hybrid"]), sum(adapter_bytes)
        ceiling = base_b / (base_b + lora_b)
        mixed_ratio = med["mixed"] / med["base"]
        print(f"mixed LoRA: {len(names)} distinct adapters, r={RANK}, one per row, on {', '.join(targets)}; a decode "
              f"step moves {base_b / 2**20:.1f} MiB (as above) and {lora_b / 2**20:.1f} MiB of adapters -> ceiling "
              f"base / (base + LoRA) = {ceiling:.3f}; measured mixed / base {mixed_ratio:.3f} "
              f"({mixed_ratio / ceiling:.0%} of the ceiling)")
        differ = sum(a != b for a, b in zip(sides["base"].ids or [], sides["mixed"].ids or []))
        print(f"rows whose greedy output the adapters changed (first round): {differ}/{args.batch}")
    print(f"total runtime {time.perf_counter() - T0:.0f} s")
    print(describe_cpu())
    print(f"{args.threads} threads on cores {cpus}")
    if refused:  # before the FIGURE lines, which end the output
        print(f"NOTE hybrid_mixed_vs_base covers target groups {', '.join(groups)} only: validation refused "
              f"{', '.join(refused)}" if groups else
              f"NOTE hybrid_mixed_vs_base n/a: validation refused every target group asked for ({', '.join(refused)})")
    print(f"FIGURE hybrid_decode_vs_dense {decode_ratio:.3f}")
    print(f"FIGURE hybrid_mixed_vs_base {'n/a' if mixed_ratio is None else f'{mixed_ratio:.3f}'}")
    return 0


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    return run(args, pin_threads(args, "hybrid linear-attention bench"))


if __name__ == "__main__":
    sys.exit(main())
