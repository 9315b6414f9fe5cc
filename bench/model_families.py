"""Mixed-adapter decode at real shapes of other families: Qwen3-0.6B and Llama-3.2-1B, loramux vs vLLM (CPU).

The lead loramux has on the 135M embedded model must hold where matmuls, not Python, dominate a step. Each
family is a directory of random float32 weights with the real model's config (the shapes, tied embeddings,
Qwen3's q/k norms, Llama-3's rope scaling) and the SmolLM2 tokenizer, written once into
~/.cache/loramux-bench/models/<name> (`--models-dir`). The token rows the tokenizer does not have (49152 and up
of the 151936 / 128256) are zero, so greedy decoding never picks a token neither engine could detokenize; the
LM head still multiplies the whole vocabulary, as the real model does.

Workload, per family: batch 8, 8 distinct random r=16 PEFT adapters (one per row) on all 7 projections,
greedy, exactly --new-tokens (64) new tokens per request with EOS ignored, the same 8 chat-templated prompts
(from bench/engine_throughput.py) as token ids on both engines. vLLM runs from its bench-only venv as
bench/vs_vllm.py's worker (in-process engine, pinned to the same cores with the same thread count); loramux
runs in this process. Prefix caching and loramux's prompt lookup are off on both. One warm-up per engine,
then rounds alternate which engine goes first; the medians of tok/s are compared. Every request must make
exactly --new-tokens tokens on both sides; the greedy outputs of the first round are compared as a check.

Ends with `FIGURE qwen3_0p6b_mixed_vs_vllm <ratio>` and `FIGURE llama3_1b_mixed_vs_vllm <ratio>` (loramux tok/s
/ vLLM tok/s; target >= 1.3). `--smoke` (= `--quick --loramux-only`) is a smoke run on tiny shapes of the same families.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import vllm_peer
from vs_vllm import ALL, RANK, VLLMWorker, agreement, loramux_generate, worker_log_path

from loramux.testing import describe_cpu, write_peft_adapter

MODELS_DIR = Path.home() / ".cache" / "loramux-bench" / "models"
TOKENIZER_VOCAB = 49152  # the SmolLM2 tokenizer every directory carries
T0 = time.perf_counter()

# The real configs (their config.json files), as transformers' own config classes take them.
FAMILIES: dict[str, tuple[str, str, dict]] = {
    "qwen3_0p6b": ("Qwen3-0.6B", "qwen3", dict(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1e6,
        tie_word_embeddings=True, attention_bias=False, bos_token_id=1, eos_token_id=2)),
    "llama3_1b": ("Llama-3.2-1B", "llama", dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
        tie_word_embeddings=True, attention_bias=False, mlp_bias=False, bos_token_id=1, eos_token_id=2)),
}
# --quick: the same families at toy sizes (seconds to build and run).
TINY = dict(vocab_size=TOKENIZER_VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32)


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


@dataclass
class Result:
    family: str
    lmx: list[float] = field(default_factory=list)  # tok/s per round
    vllm: list[float] = field(default_factory=list)
    lmx_ids: list[list[int]] | None = None
    vllm_ids: list[list[int]] | None = None


# --- checkpoints -------------------------------------------------------------------------------------------


def build_checkpoint(out: Path, model_type: str, config_kwargs: dict, tokenizer_dir: Path) -> Path:
    """Write random float32 weights of a family's real shapes, its config and the SmolLM2 tokenizer into `out`
    (once: a stamp marks a finished directory). Matrices ~ N(0, 0.02^2), norm weights 1, and the embedding /
    LM head rows of tokens the tokenizer lacks are zero."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    stamp = out / ".complete"
    if stamp.is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    config = AutoConfig.for_model(model_type, **config_kwargs)
    with torch.device("meta"):
        meta_model = AutoModelForCausalLM.from_config(config)
    config.architectures = [type(meta_model).__name__]  # vLLM picks its runner (generate) from this
    shapes = {k: (v.shape, v.dim()) for k, v in meta_model.state_dict().items()}
    g, tensors = torch.Generator().manual_seed(0), {}
    for name, (shape, dim) in shapes.items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if dim == 1:
            tensors[name] = torch.ones(shape)
            continue
        t = torch.empty(shape).normal_(0.0, 0.02, generator=g)
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            t[TOKENIZER_VOCAB:] = 0
        tensors[name] = t
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config.save_pretrained(out)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)
    stamp.write_text("ok\n")
    return out


# --- main --------------------------------------------------------------------------------------------------


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="short run: tiny shapes, 4 new tokens, 1 round")
    ap.add_argument("--loramux-only", action="store_true", help="do not start vLLM")
    ap.add_argument("--smoke", action="store_true", help="smoke run (what the tests run): --quick --loramux-only")
    ap.add_argument("--families", default=",".join(FAMILIES), help=f"comma-separated, of {', '.join(FAMILIES)}")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds (default 3, --quick 1)")
    ap.add_argument("--new-tokens", type=int, default=None, help="tokens per request (default 64, --quick 4)")
    ap.add_argument("--warmup-tokens", type=int, default=None, help="tokens per request of the warm-up (default 8)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                    help="threads (and cores) per engine (default: all allowed cores)")
    ap.add_argument("--kv-cache-gib", type=int, default=2, help="vLLM's KV cache (VLLM_CPU_KVCACHE_SPACE)")
    ap.add_argument("--models-dir", type=Path, default=MODELS_DIR, help="where the random checkpoints are kept")
    args = ap.parse_args(argv)
    args.quick, args.loramux_only = args.quick or args.smoke, args.loramux_only or args.smoke
    args.families = [f for f in args.families.split(",") if f]
    unknown = set(args.families) - set(FAMILIES)
    if unknown:
        ap.error(f"unknown families {sorted(unknown)}; choose from {', '.join(FAMILIES)}")
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.new_tokens = args.new_tokens or (4 if args.quick else 64)
    args.warmup_tokens = min(args.warmup_tokens or (2 if args.quick else 8), args.new_tokens)
    return args


def make_engine(model_dir: Path, num_adapters: int, model_cfg):
    from loramux.adapters.formats.validation import projection_shapes
    from loramux.engine.engine import LLMEngine
    from loramux.settings import Settings

    shapes = projection_shapes(model_cfg)
    per_adapter = 4 * RANK * model_cfg.num_layers * sum(sum(shapes[t]) for t in ALL)  # float32 A and B
    settings = Settings(model=str(model_dir), dtype="float32", device="cpu", max_lora_rank=RANK,
                        prefix_caching=False, speculative_tokens=0, kv_cache_bytes=512 * 2**20,
                        adapter_pool_bytes=num_adapters * per_adapter + 64 * 2**20, max_model_len=4096)
    return LLMEngine.from_settings(settings, load_adapters=False)


def run_family(args, key: str, cpus: list[int]) -> Result:
    import gc

    from engine_throughput import PROMPTS

    from loramux.model.loader import read_model_config, resolve_model_dir
    from loramux.settings import Settings

    label, model_type, kwargs = FAMILIES[key]
    if args.quick:
        kwargs = {**kwargs, **TINY, "tie_word_embeddings": kwargs["tie_word_embeddings"]}
        label += " (tiny shapes)"
    smollm = resolve_model_dir("SmolLM2-135M-Instruct", Path(Settings().cache_dir))
    model_dir = args.models_dir / (key + ("-tiny" if args.quick else ""))
    log(f"{label}: checkpoint {model_dir}")
    build_checkpoint(model_dir, model_type, kwargs, smollm)
    model_cfg, _ = read_model_config(model_dir)
    names = [f"{key}-ad{i}" for i in range(args.batch)]
    adapters_dir = args.models_dir / f"{model_dir.name}-adapters"
    paths = {}
    for i, name in enumerate(names):
        path = adapters_dir / name
        if not (path / "adapter_model.safetensors").is_file():
            write_peft_adapter(path, model_cfg, RANK, ALL, seed=i, b_std=0.02)
        paths[name] = path
    result = Result(label)
    worker = None
    try:
        if not args.loramux_only:
            log(f"{label}: starting the vLLM worker")
            worker = VLLMWorker(model_dir, paths, max_loras=args.batch, threads=args.threads, cpus=cpus,
                                kv_cache_gib=args.kv_cache_gib, max_num_seqs=args.batch, max_model_len=4096,
                                log_path=worker_log_path())
            log(f"{label}: vLLM {worker.info['vllm']} up in {worker.info['startup_s']:.1f} s; log {worker.log_path}")
        log(f"{label}: building the loramux engine")
        engine = make_engine(model_dir, args.batch, model_cfg)
        for name, path in paths.items():
            engine.load_adapter_dir(path, name)
        chats = [engine.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
        prompts = [chats[j % len(chats)] for j in range(args.batch)]

        def run(side: str, new_tokens: int) -> tuple[float, list[list[int]]]:
            if side == "loramux":
                elapsed, out = loramux_generate(engine, prompts, names, new_tokens)
            else:
                elapsed, out = worker.generate(prompts, names, new_tokens)
            counts = [len(o) for o in out]
            if counts != [new_tokens] * args.batch:
                raise RuntimeError(f"{side} {label}: requests produced {counts} tokens, expected {new_tokens} each")
            return args.batch * new_tokens / elapsed, out

        sides = ["loramux", "vllm"] if worker else ["loramux"]
        for side in sides:
            tps, _ = run(side, args.warmup_tokens)
            log(f"{label}: warm-up {side:8s} {tps:7.2f} tok/s")
        for r in range(args.rounds):
            for side in (sides if r % 2 == 0 else sides[::-1]):
                tps, out = run(side, args.new_tokens)
                (result.lmx if side == "loramux" else result.vllm).append(tps)
                if r == 0:
                    setattr(result, "lmx_ids" if side == "loramux" else "vllm_ids", out)
                log(f"{label}: round {r + 1}/{args.rounds} {side:8s} {tps:7.2f} tok/s")
    finally:
        if worker is not None:
            worker.close()
        engine = None
        gc.collect()
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    cpus = vllm_peer.pick_cpus(args.threads)
    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(args.threads)
    print(f"model families vs vLLM{' (quick)' if args.quick else ''}: float32, greedy, batch {args.batch}, "
          f"{args.batch} distinct r={RANK} adapters on all 7 projections, {args.new_tokens} new tokens per request "
          f"(EOS ignored); one warm-up each, then {args.rounds} round(s) alternating who goes first (median); "
          f"{time.strftime('%Y-%m-%d %H:%M')}")
    print(describe_cpu())
    print(f"{args.threads} threads per engine on cores {cpus}")
    results = [run_family(args, key, cpus) for key in args.families]

    print(f"\n{'family':32s}{'loramux tok/s':>15s}{'vLLM tok/s':>13s}{'loramux/vLLM':>14s}")
    for res in results:
        lmx = statistics.median(res.lmx)
        vl = statistics.median(res.vllm) if res.vllm else None
        print(f"{res.family:32s}{lmx:15.2f}{vl if vl else float('nan'):13.2f}"
              f"{lmx / vl if vl else float('nan'):14.2f}   rounds loramux {[round(v, 2) for v in res.lmx]}"
              f" vLLM {[round(v, 2) for v in res.vllm]}")
        if res.vllm_ids is not None:
            print(f"  greedy agreement (loramux vs vLLM, fp32): {agreement(res.lmx_ids, res.vllm_ids)}")
    print(f"total runtime {time.perf_counter() - T0:.0f} s")
    print(describe_cpu())
    for key, res in zip(args.families, results):
        if res.vllm:
            print(f"FIGURE {key}_mixed_vs_vllm {statistics.median(res.lmx) / statistics.median(res.vllm):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
