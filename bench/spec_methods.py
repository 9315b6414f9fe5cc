"""Speculative decoding by Medusa heads and a draft model on the embedded SmolLM2-135M-Instruct (float32, CPU),
next to decoding without speculation, on general chat prompts (not the summarisation prompts prompt lookup
is measured on in bench/speculative.py, and none of the prompts the speculators were trained on).

Configurations (one engine from Settings, adaptive speculation on as served; the engine's methods and draft
length are switched per call): "none" = `speculative=False`; "medusa" = the heads shipped for the model
(`loramux medusa train --ship`); "draft" = the distilled draft (`loramux draft distill`, made once into the
bench cache); "adapter none" / "adapter medusa" = requests for a rank-16 adapter, without speculation and
with heads trained for that adapter on its own answers (`loramux medusa train --adapter`, made once into the
bench cache). Batch 1: one request at a time, greedy, until end-of-turn or --new-tokens; within a round each
prompt runs under every configuration in turn (rotating order); tok/s = tokens / the sum over prompts of the
median time over rounds. Outputs are checked token for token: every configuration must equal "none" (the
script exits otherwise). Batch 16: 16 concurrent streams (the prompts cycled), adaptive speculation with every
method against no speculation, alternating rounds, medians of total tok/s. `--full`: also the batch sweep
(1, 2, 4, 8, 16) per method, plotted into docs/spec_batch.png.

Ends with FIGURE medusa_speedup_b1, FIGURE draft_speedup_b1, FIGURE medusa_adapter_speedup_b1 and FIGURE
spec_b16_on_vs_off, and prints the acceptance length (tokens per verification) per method.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from smoke import SMOKE_HELP, model_label, tiny_medusa_heads, tiny_model

CHAT = [
    "How do I make a good cup of tea?",
    "What are the health benefits of regular exercise?",
    "Explain how a bicycle works.",
    "Write a short email inviting my colleagues to a team lunch on Friday.",
    "What is the difference between weather and climate?",
    "Give me some tips for learning a new language.",
    "Describe the planet Mars.",
    "Write a Python function that returns the largest number in a list.",
]
CACHE = Path.home() / ".cache" / "loramux-bench" / "spec"


def ensure_adapter(cfg) -> Path:
    """A rank-16 adapter on every projection (random, seeded: it changes the model's answers, as a fine-tune
    does, and heads for it must learn those answers)."""
    from loramux.testing import write_peft_adapter

    path = CACHE / "adapter"
    if not (path / "adapter_model.safetensors").is_file():
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        write_peft_adapter(path, cfg, 16, targets, seed=7, b_std=0.01)
    return path


def ensure(what: str, path: Path, command: list[str]) -> Path:
    """Make a speculator once with the project's own command (long the first time; cached after)."""
    from loramux.child_python import python_command

    if not path.is_dir():
        print(f"making the {what} once: {' '.join(command)} (cached in {path})", flush=True)
        subprocess.run(python_command("-m", "loramux.cli", *command, "--out", str(path)), check=True)
    return path


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=4, help="chat prompts at batch 1 (of 8)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--full", action="store_true", help="all 8 prompts, 3 rounds, and the batch sweep with its plot")
    ap.add_argument("--no-draft", action="store_true", help="leave the draft model out")
    ap.add_argument("--no-adapter", action="store_true", help="leave the adapter's heads out")
    ap.add_argument("--quick", action="store_true", help="short run: 1 prompt, 8 tokens, 1 round, Medusa only")
    ap.add_argument("--smoke", action="store_true", help=f"--quick on the tiny model and random heads: {SMOKE_HELP}")
    args = ap.parse_args(argv)
    if args.full:
        args.prompts, args.rounds = len(CHAT), 3
    args.quick = args.quick or args.smoke
    if args.smoke:
        tiny_model()
        tiny_medusa_heads()
    if args.quick:
        args.prompts, args.rounds, args.new_tokens, args.no_draft, args.no_adapter = 1, 1, 8, True, True
    torch.set_num_threads(args.threads)

    from loramux.adapters.formats.medusa import load_medusa_dir
    from loramux.engine.engine import LLMEngine
    from loramux.engine.sampling.params import SamplingParams
    from loramux.settings import Settings
    from loramux.testing import describe_cpu

    t_start = time.perf_counter()
    engine = LLMEngine.from_settings(Settings(dtype="float32", device="cpu", prefix_caching=False))
    cfg = engine.model.config
    assert engine.medusa_base is not None, "no shipped Medusa heads: run `loramux medusa train --ship`"
    configs = {"none": {}, "medusa": {"methods": "medusa"}}
    if not args.no_draft:
        from loramux.engine.speculation.draft_runner import DraftRunner
        from loramux.model.loader import build_model

        draft_dir = ensure("distilled draft", CACHE / "draft", ["draft", "distill"])
        draft_model, _ = build_model(draft_dir, torch.float32, torch.device("cpu"), engine.max_model_len)
        engine.set_draft_model(DraftRunner(draft_model, 64 * 1024**2, engine.config.block_size, torch.float32,
                                           torch.device("cpu"), engine.max_model_len))
        configs["draft"] = {"methods": "draft"}
    adapter_heads = None
    if not args.no_adapter:
        adapter_dir = ensure_adapter(cfg)
        engine.load_adapter_dir(adapter_dir, "bench-adapter", allow_base_mismatch=True)
        heads_dir = ensure("adapter's Medusa heads", CACHE / "adapter-medusa",
                           ["medusa", "train", "--adapter", str(adapter_dir), "--limit", "160"])
        adapter_heads = load_medusa_dir(heads_dir, cfg.hidden_size)
        configs["adapter none"] = {"adapter": "bench-adapter"}
        configs["adapter medusa"] = {"adapter": "bench-adapter", "methods": "medusa", "heads": adapter_heads}
    prompts = [engine.encode_chat([{"role": "user", "content": p}]) for p in CHAT[:args.prompts]]
    print(describe_cpu())
    print(f"{model_label(args.smoke)} float32, threads={args.threads}, greedy, until end-of-turn or {args.new_tokens} "
          f"tokens, {len(prompts)} chat prompts at batch 1, rounds={args.rounds}, {time.strftime('%Y-%m-%d')}; "
          f"draft length {engine.config.speculative_tokens}, adaptive speculation on", flush=True)

    def run(config: dict, batch: list[list[int]]) -> tuple[list[list[int]], float, dict]:
        engine.config.speculative_methods = config.get("methods", "ngram,medusa,draft")
        on = "methods" in config
        params = SamplingParams(max_tokens=args.new_tokens, speculative=on)
        before = engine.stats()["speculation"]
        ids = [f"b-{time.monotonic_ns()}-{i}" for i in range(len(batch))]
        t0 = time.perf_counter()
        for rid, prompt in zip(ids, batch):
            heads = engine.prepare_medusa(config["heads"]) if config.get("heads") else None  # device copy, pinned
            engine.add_request(rid, prompt, params, adapter=config.get("adapter"), medusa=heads)
        final = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    final[out.request_id] = list(out.token_ids)
        dt = time.perf_counter() - t0
        after = engine.stats()["speculation"]
        delta = {m: {k: after[m][k] - before[m][k] for k in after[m]} for m in after}
        return [final[r] for r in ids], dt, delta

    names = list(configs)
    reference: dict[tuple[str, int], list[int]] = {}

    def check(name: str, i: int, got: list[int]) -> None:
        key = ("adapter" if name.startswith("adapter") else "base", i)
        want = reference.setdefault(key, got)
        if got != want:
            sys.exit(f"ENGINE BUG: {name} differs from decoding without speculation on chat prompt {i}")

    for i in range(min(2, len(prompts))):  # warm-up; fixes the reference outputs
        for name in names:
            check(name, i, run(configs[name], [prompts[i]])[0][0])
    secs = {n: [[] for _ in prompts] for n in names}
    spec = {n: {"proposed": 0, "accepted": 0, "verifications": 0} for n in names}
    tokens = {n: 0 for n in names}
    for r in range(args.rounds):
        for i, prompt in enumerate(prompts):
            order = names[(r + i) % len(names):] + names[:(r + i) % len(names)]
            for name in order:
                out, dt, delta = run(configs[name], [prompt])
                check(name, i, out[0])
                secs[name][i].append(dt)
                tokens[name] += len(out[0])
                for counts in delta.values():
                    for k in spec[name]:
                        spec[name][k] += counts[k]
            print(f"  round {r + 1} prompt {i + 1}: " + ", ".join(f"{n} {secs[n][i][-1]:.1f} s" for n in order)
                  + f" [{time.perf_counter() - t_start:.0f} s]", flush=True)
    n_tok = {n: tokens[n] / args.rounds for n in names}
    med = {n: n_tok[n] / sum(statistics.median(s) for s in secs[n]) for n in names}
    print(f"\n{'configuration':16s} {'tok/s':>7s} {'speedup':>7s} {'accepted/proposed':>18s} {'tokens/verify':>13s}")
    for n in names:
        ref = med["adapter none"] if n.startswith("adapter") else med["none"]
        s = spec[n]
        acc = f"{s['accepted']}/{s['proposed']}" if s["proposed"] else ""
        length = f"{1 + s['accepted'] / s['verifications']:.2f}" if s["verifications"] else ""
        print(f"{n:16s} {med[n]:7.1f} {med[n] / ref:7.2f} {acc:>18s} {length:>13s}")

    # 16 concurrent streams: adaptive speculation (every method) against none.
    streams = [prompts[i % len(prompts)] if i < len(prompts) else
               engine.encode_chat([{"role": "user", "content": CHAT[i % len(CHAT)]}]) for i in range(16)]
    b16 = {"on": [], "off": []}
    for r in range(args.rounds + 1):
        for label in (("on", "off") if r % 2 else ("off", "on")):
            config = {"methods": "ngram,medusa" + ("" if args.no_draft else ",draft")} if label == "on" else {}
            outs, dt, _ = run(config, streams)
            if r:  # round 0 warms up
                b16[label].append(sum(map(len, outs)) / dt)
    b16_ratio = statistics.median(b16["on"]) / statistics.median(b16["off"])
    print(f"batch 16: adaptive speculation on {statistics.median(b16['on']):.1f} tok/s, off "
          f"{statistics.median(b16['off']):.1f} tok/s (rounds: on {[round(x, 1) for x in b16['on']]}, off "
          f"{[round(x, 1) for x in b16['off']]})")
    if args.full:
        sweep(run, configs, prompts)
    print(f"total {time.perf_counter() - t_start:.0f} s")
    figures = {"medusa_speedup_b1": med["medusa"] / med["none"]}
    if "draft" in med:
        figures["draft_speedup_b1"] = med["draft"] / med["none"]
    if "adapter medusa" in med:
        figures["medusa_adapter_speedup_b1"] = med["adapter medusa"] / med["adapter none"]
    figures["spec_b16_on_vs_off"] = b16_ratio
    for name, value in figures.items():
        print(f"FIGURE {name} {value:.2f}")
    return figures


def sweep(run, configs: dict, prompts: list[list[int]]) -> None:
    """Speedup over no speculation at batch 1, 2, 4, 8, 16 per method (adaptive), plotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [1, 2, 4, 8, 16]
    methods = [m for m in ("medusa", "draft") if m in configs] + ["ngram"]
    speedups = {m: [] for m in methods}
    for size in sizes:
        batch = [prompts[i % len(prompts)] for i in range(size)]
        base = []
        for _ in range(2):
            outs, dt, _ = run({}, batch)
            base.append(sum(map(len, outs)) / dt)
        for m in methods:
            rates = []
            for _ in range(2):
                outs, dt, _ = run({"methods": m}, batch)
                rates.append(sum(map(len, outs)) / dt)
            speedups[m].append(statistics.median(rates) / statistics.median(base))
        print(f"  batch {size}: " + ", ".join(f"{m} {speedups[m][-1]:.2f}x" for m in methods), flush=True)
    fig, ax = plt.subplots(figsize=(6, 4))
    for m in methods:
        ax.plot(sizes, speedups[m], marker="o", label=m)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(s) for s in sizes])
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("tokens/s vs no speculation")
    ax.set_title("Speculation on SmolLM2-135M (CPU, adaptive)")
    ax.legend()
    out = Path(__file__).resolve().parent.parent / "docs" / "spec_batch.png"
    fig.savefig(out, dpi=110, bbox_inches="tight")
    print(f"plot: {out}")


if __name__ == "__main__":
    main()
