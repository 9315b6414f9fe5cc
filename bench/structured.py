"""Structured output in the batch step: the engine's decode step time with 0, 1 and all rows under a JSON schema.

bench/grammar_engines.py measures the grammar engines' per-token mask alone; this measures what a whole engine
step costs when rows of the batch are constrained: the forward, the sampler applying the gathered masks, and
each constrained row's accept-and-fill of its next mask after sampling.

Workload: a batch of --batch requests (default 8), chat-templated prompts asking for JSON, greedy, --tokens new
tokens each (default 32). Constrained rows follow a JSON schema: an array of at least 64 of grammar_engines'
"flat" records (strings, an integer range, an e-mail pattern, a boolean, a number), which no row can finish
within the tokens asked, so every row decodes to the end; unconstrained rows ignore EOS. Configurations: none
(0 rows constrained), one (row 0) and all rows.
Model: the embedded SmolLM2-135M-Instruct, float32 on CPU, one torch thread (--threads), the engine as
`loramux serve` builds it from Settings, speculation off (one token per row and step). `--tiny`: bench/smoke.py's
tiny random Llama with SmolLM2's tokenizer: its step is so small that the mask dominates and its ratio says
little. `--smoke` (what the tests run): `--tiny --rounds 1 --tokens 8`.

One engine per configuration (the same Settings), so that their steps can take turns: per round, each
engine gets its batch, then the three step one step at a time in turn (the order alternates round by round)
until all finish, and bursts of other load on a shared machine land on every configuration alike. Timed:
each step that starts with every row of its batch decoding (prefill steps left out); a round's value is the
median of those steps, after one untimed warm-up round. Reported: medians over --rounds (default 5).
About 3 minutes here with the embedded model (under a CI run's load; the model loads three times); --smoke about
15 s.
Ends with FIGURE json_schema_step_overhead <median step, all rows constrained / none>.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from grammar_engines import SCHEMAS
from smoke import SMOKE_HELP, model_label, tiny_model

from loramux.testing import describe_cpu

SCHEMA = {"type": "array", "items": SCHEMAS["flat"], "minItems": 64}
TOPICS = ["the chess club", "a bakery", "a hospital ward", "the football team", "a library", "an orchestra",
          "a start-up", "a school class", "a hiking group", "a choir", "a lab", "a ferry crew"]


def build_engine(model: str):
    """The engine as the server builds it from Settings, float32 on CPU, without speculation."""
    from loramux.engine.engine import LLMEngine
    from loramux.settings import Settings

    return LLMEngine.from_settings(Settings(model=model, dtype="float32", device="cpu", speculative_tokens=0),
                                   load_adapters=False)


class Batch:
    """One batch in its own engine: the first `constrained` rows under `spec`, every row generating exactly
    `tokens` tokens; `step()` runs one engine step and returns its seconds when every row was decoding."""

    def __init__(self, engine, prompts: list[list[int]], constrained: int, tokens: int, spec):
        from loramux.engine.sampling.params import SamplingParams

        self.engine, self.tokens, self.generated = engine, tokens, {}
        for i, prompt in enumerate(prompts):
            structured = spec if i < constrained else None
            params = SamplingParams(max_tokens=tokens, ignore_eos=structured is None, structured=structured)
            rid = f"row{i}-{time.monotonic_ns()}"
            engine.add_request(rid, prompt, params)
            self.generated[rid] = 0

    @property
    def done(self) -> bool:
        return not self.engine.has_unfinished()

    def step(self) -> float | None:
        decoding = all(self.generated.values())
        t0 = time.perf_counter()
        outputs = self.engine.step()
        seconds = time.perf_counter() - t0
        for out in outputs:
            self.generated[out.request_id] = len(out.token_ids)
            if out.finished and (out.finish_reason != "length" or len(out.token_ids) != self.tokens):
                raise RuntimeError(f"{out.request_id} ended early: {out.finish_reason}, {len(out.token_ids)} tokens")
        return seconds if decoding else None


def run_round(batches: dict[str, Batch]) -> dict[str, list[float]]:
    """Step the batches in turn, one step each (in the dict's order), until all finish; each one's decode step
    times. Taking turns step by step spreads bursts of other load on the machine over every configuration."""
    times: dict[str, list[float]] = {name: [] for name in batches}
    while not all(b.done for b in batches.values()):
        for name, batch in batches.items():
            if not batch.done and (seconds := batch.step()) is not None:
                times[name].append(seconds)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=None, help="new tokens per request (default 32, --smoke 8)")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds (default 5, --smoke 1)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: on a shared 2-vCPU VM, other jobs make 2-thread OpenMP barriers "
                         "wait for descheduled threads; a loaded run took 1.2-2.3 s per step with 2, 0.18 s with 1)")
    ap.add_argument("--tiny", action="store_true", help="a tiny random model instead of SmolLM2")
    ap.add_argument("--smoke", action="store_true", help=f"--tiny --rounds 1 --tokens 8: {SMOKE_HELP}")
    args = ap.parse_args()
    args.tiny = args.tiny or args.smoke
    args.tokens = args.tokens or (8 if args.smoke else 32)
    args.rounds = args.rounds or (1 if args.smoke else 5)
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()

    from loramux.engine.sampling.params import StructuredOutput

    print(describe_cpu())
    configs = {"none": 0, "one": 1, "all": args.batch}
    model = str(tiny_model()) if args.tiny else "SmolLM2-135M-Instruct"
    engines = {name: build_engine(model) for name in configs}  # one each: their steps can take turns
    spec = StructuredOutput("json_schema", json.dumps(SCHEMA))
    t0 = time.perf_counter()
    engines["all"].compile_structured(spec)
    compile_ms = (time.perf_counter() - t0) * 1e3
    for name in ("none", "one"):
        engines[name].compile_structured(spec)
    print(f"model {model_label(args.tiny)} float32, {args.threads} thread(s), batch {args.batch}, greedy, "
          f"{args.tokens} new tokens per request, {args.rounds} rounds (medians), one engine per configuration, their "
          f"steps taking turns; schema compiled in {compile_ms:.0f} ms; {time.strftime('%Y-%m-%d %H:%M')}", flush=True)
    chat = engines["none"].encode_chat
    prompts = [chat([{"role": "user", "content": f"List the members of {TOPICS[i % len(TOPICS)]} as JSON "
                      "records with name, age, email, active and score."}]) for i in range(args.batch)]

    def batches(order: list[str]) -> dict[str, Batch]:
        return {n: Batch(engines[n], prompts, configs[n], args.tokens, spec) for n in order}

    run_round(batches(list(configs)))  # warm-up, untimed
    print(f"warmed up [{time.perf_counter() - t_start:.0f} s]", flush=True)
    medians: dict[str, list[float]] = {name: [] for name in configs}
    for r in range(args.rounds):
        times = run_round(batches(list(configs) if r % 2 == 0 else list(configs)[::-1]))
        for name in configs:
            medians[name].append(statistics.median(times[name]))
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{n} {medians[n][-1] * 1e3:.2f} ms" for n in configs)
              + f" per decode step ({len(times['none'])} steps each) [{time.perf_counter() - t_start:.0f} s]",
              flush=True)
    step = {name: statistics.median(values) for name, values in medians.items()}
    for name, constrained in configs.items():
        print(f"{name:4s} ({constrained}/{args.batch} rows constrained): median decode step {step[name] * 1e3:.2f} ms "
              f"({step[name] / step['none']:.3f}x none)")
    print(f"FIGURE json_schema_step_overhead {step['all'] / step['none']:.3f}")


if __name__ == "__main__":
    main()
