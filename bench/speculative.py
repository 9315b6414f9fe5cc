"""Speculative decoding at batch 1. First (unless --lookup-only) bench/spec_methods.py: Medusa heads, the
distilled draft model, an adapter's own heads and adaptive speculation at 16 streams, on chat prompts (its
FIGUREs: medusa_speedup_b1, draft_speedup_b1, medusa_adapter_speedup_b1, spec_b16_on_vs_off; options it
does not know here pass through to it, e.g. --no-draft). Then prompt lookup: loramux with and without it, and
HF's `generate(prompt_lookup_num_tokens=K)` against plain greedy `generate`, on the same prompts.

Workload: summarisation / extraction chat prompts (a paragraph or two of text, then an instruction:
summarise quoting the key sentences, list the names, explain the code, ...), the kind of request
prompt lookup is meant for: the answer copies spans of the prompt. Greedy, chat-templated, one
request at a time (batch 1), each generating until its end-of-turn token or --new-tokens. Both
sides produce the same tokens (checked), so both count the same tokens.

loramux: one engine (float32, prefix caching off so every request pays its own prefill, as HF's
`generate` does). "Without" = `SamplingParams(speculative=False)`; "with, K" = the engine's
`speculative_tokens` set to K (the config is read at every step). tokens/s = generated tokens /
wall time from `add_request` to the finished output, over all prompts. Acceptance
rate = accepted / proposed draft tokens (`engine.stats()`); tokens per step = generated tokens /
engine steps after the prefill step; ms/step = the median wall time of those steps (a plain decode
step without speculation; with it, the verification steps of 1 + len(draft) tokens and the plain
decode steps where no draft was found).

HF: the same weights (float32), the same token ids, the same torch threads; `generate` greedy with
and without `prompt_lookup_num_tokens=K` (HF's other prompt-lookup setting, max_matching_ngram_size,
left at its default).

Default run (with spec_methods' default, about 5 minutes on a quiet 2-vCPU machine once its speculators are
made and cached): loramux without speculation and at the default K only, the first 4 prompts, 2 rounds; the
warm-up runs every configuration once on one prompt. `--full` is the long
sweep of docs/performance.md (about 18-23 minutes for prompt lookup): all 8 prompts, 3 rounds, K in
2,3,4,5,8, HF `generate` with and without prompt lookup (`--hf` adds the HF rows to any run), and a warm-up
pass of every configuration over every prompt.
Within a round each prompt runs under every configuration in turn (the order rotates per round and prompt).
The reported tok/s of a configuration is all its tokens / the sum over prompts of that prompt's median time
over the rounds (each round's own tok/s is printed too): on a shared 2-vCPU machine another job can slow one
call many times over, and a per-prompt median keeps one such call from moving the result. Outputs are
checked on every call: loramux with and without speculation must be identical token for token, and the same
in every round (the script fails otherwise); a difference from HF is reported as a warning. Progress (round,
prompt, seconds per configuration, elapsed seconds) is printed as it goes.

Ends with `FIGURE spec_speedup <loramux with prompt lookup at the default K / without, tok/s median
ratio>`.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from smoke import SMOKE_HELP, model_label, tiny_model

from loramux.testing import describe_cpu

MEETING = """\
Weekly platform sync, 14 November. Present: Priya Raman (chair), Tomasz Nowak, Helen Okafor, \
Diego Alvarez, Mei Lin.

1. Release 4.2. Tomasz reported that the release branch is frozen and that the two remaining \
blockers are the login timeout on Safari and the slow export of large reports. Helen said the Safari \
fix is merged and waiting for QA. The export problem is caused by the report builder loading every \
row into memory; Diego proposed streaming the rows to the file instead. Decision: the release moves \
from 18 November to 21 November so that the streaming export can be tested.

2. On-call. Mei said that the pager fired 23 times last week, 17 of them for the disk usage alert on \
the log servers. Decision: raise the disk alert threshold from 80 % to 90 % and add log rotation \
for the audit logs. Mei owns this.

3. Hiring. Priya confirmed that the second backend position has been approved. Interviews start \
in December; Helen and Diego will run the technical interviews.

Action items: Diego - streaming export by 19 November. Mei - alert threshold and log rotation. \
Helen - QA sign-off for the Safari fix. Priya - send the job description to HR."""

PRODUCT = """\
The Aurora 300 is a compact espresso machine for small kitchens. It heats up in 25 seconds thanks \
to its thermoblock heater, and its 15-bar Italian pump extracts a full-bodied espresso with a thick \
crema. The steam wand swivels 180 degrees and can be switched to hot water for tea or americanos. \
The 1.2-litre water tank slides out from the front, so the machine fits under wall cabinets, and a \
built-in water filter reduces limescale. Three programmable buttons remember your preferred volume \
for a single shot, a double shot and a lungo. The drip tray is dishwasher safe, and the machine \
switches itself off after 20 minutes without use to save energy. The Aurora 300 comes with a \
stainless steel milk jug, a tamper, single and double filter baskets and a two-year warranty. It \
measures 18 cm wide, 30 cm deep and 31 cm high, and weighs 4.1 kg."""

CODE = '''\
def merge_intervals(intervals):
    """Merge overlapping closed intervals given as (start, end) pairs."""
    if not intervals:
        return []
    ordered = sorted(intervals, key=lambda pair: pair[0])
    merged = [list(ordered[0])]
    for start, end in ordered[1:]:
        last = merged[-1]
        if start <= last[1]:
            last[1] = max(last[1], end)
        else:
            merged.append([start, end])
    return [tuple(pair) for pair in merged]'''

COMPLAINT = """\
Dear customer service,

I am writing about order number 58812, which I placed on 3 October for a pair of walking boots and \
a waterproof jacket. The boots arrived on 9 October, but the jacket never arrived, even though the \
tracking page has said "out for delivery" since 10 October. I contacted your chat support twice. The \
first agent told me to wait five more working days, and the second agent promised a refund within \
48 hours, but I have not received any refund or any email confirming it. In addition, the boots are \
one size too small, and the returns page rejects my order number with the message "order not \
eligible". I would like a full refund for the jacket, a prepaid return label for the boots, and a \
written confirmation of both by email. If this is not resolved by the end of the month, I will ask \
my bank to reverse the payment.

Kind regards,
Laura Bennett"""

COUNCIL = """\
The Millbrook town council voted on Tuesday to convert the old railway depot on Station Road into a \
community library and workshop space. Mayor Alan Whitfield said the project would "give the east \
side of town the public space it has been missing for thirty years". Councillor Rosa Delgado, who \
chairs the planning committee, presented the budget of 2.4 million pounds, of which 1.5 million will \
come from a regional heritage grant. Councillor Martin Hughes voted against the plan, arguing that the \
money should first be spent on repairing the town's roads. The architect, Sunita Kapoor, expects the \
building work to start next spring and to last about eighteen months. Local historian Edward Price \
welcomed the decision and offered to lend his collection of railway photographs for an exhibition \
at the opening."""

INCIDENT = """\
Incident report: checkout outage, 2 November, 14:05-14:52 UTC.

Summary: for 47 minutes about 60 % of checkout requests failed with HTTP 503. Payments that had \
already been authorised were not affected.

Timeline: at 13:58 a configuration change reduced the connection pool of the payments service from \
200 to 20 connections; the change was meant for the staging environment but was applied to \
production. At 14:05 the error rate of the checkout API rose above 50 % and the on-call engineer \
was paged. At 14:31 the team identified the connection pool as the bottleneck. At 14:44 the \
configuration was reverted, and at 14:52 the error rate returned to normal.

Root cause: the deployment tool used the production configuration file when the staging profile \
was selected, because both files shared the same name in different folders.

Follow-up actions: rename the configuration files so that the environment is part of the file name; \
require a second reviewer for any production configuration change; add an alert on the connection \
pool saturation of the payments service."""

ABSTRACT = """\
Urban heat islands raise night-time temperatures in cities, and trees are often proposed as a \
remedy. We measured air temperature every ten minutes for two summers at 120 sites in three mid-sized \
European cities, and mapped the tree canopy within 100 metres of each site from aerial images. Sites \
with more than 40 % canopy cover were on average 2.1 degrees cooler at 2 a.m. than sites with less than \
10 % canopy cover, and the difference grew to 3.4 degrees during heatwaves. The cooling effect was \
strongest in narrow streets and weakest in open squares. Grass without trees had almost no effect at \
night. We conclude that planting street trees is an effective way to reduce night-time heat, and that \
the benefit is largest where buildings are close together."""

JOB = """\
Northwind Logistics is looking for a Senior Data Engineer to join our analytics team in Rotterdam \
(hybrid, three days a week in the office). You will build and maintain the pipelines that bring \
shipment, warehouse and customer data into our data warehouse, and you will work closely with the \
analysts who build our forecasting models.

Requirements: at least five years of experience as a data engineer; strong SQL and Python; \
experience with Apache Airflow or a similar workflow scheduler; experience with a cloud data \
warehouse such as BigQuery, Snowflake or Redshift; good written English. Nice to have: experience \
with Kafka, knowledge of Dutch, and a background in logistics or supply chains.

We offer a salary between 70,000 and 85,000 euros, 27 days of holiday, a yearly training budget of \
2,000 euros and a pension plan. Send your CV and a short motivation letter to careers@northwind.example \
before 15 January."""

# (text, instruction): real summarisation / extraction requests, not tuned for copying.
PROMPTS = [
    (MEETING, "Summarise the meeting notes above, quoting the key decisions word for word."),
    (PRODUCT, "List every feature of the Aurora 300 mentioned in the description above."),
    (CODE, "Explain what the function above does, step by step, referring to its variable names."),
    (COMPLAINT, "Summarise the customer's complaint above and list exactly what she asks for."),
    (COUNCIL, "List every person mentioned in the article above, with their role and what they said or did."),
    (INCIDENT, "Summarise the incident report above: what happened, the root cause and the follow-up actions."),
    (ABSTRACT, "Summarise the abstract above in three sentences, quoting the key results."),
    (JOB, "Extract the requirements and the nice-to-have skills from the job posting above as two lists."),
]


def chat_ids(engine, text: str, instruction: str) -> list[int]:
    return engine.encode_chat([{"role": "user", "content": f"{text}\n\n{instruction}"}])


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def open_loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return f.read().split()[0]
    except OSError:
        return "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ks", default=None,
                    help="loramux draft lengths to measure (default: the default K; --full: 2,3,4,5,8)")
    ap.add_argument("--default-k", type=int, default=None,
                    help="K behind the FIGURE (default: the engine's default, Settings().speculative_tokens)")
    ap.add_argument("--hf-ks", default=None, help="HF prompt_lookup_num_tokens values (default: the default K)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=4, help="use the first N prompts (--full: all 8)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--hf", action="store_true", help="add HF generate with and without prompt lookup")
    ap.add_argument("--skip-hf", action="store_true", help="no HF rows, even with --full or --quick")
    ap.add_argument("--full-warmup", action="store_true",
                    help="warm up with every configuration over every prompt (default: over the first prompt)")
    ap.add_argument("--full", action="store_true",
                    help="the long sweep: K in 2,3,4,5,8, the HF rows, the full warm-up pass (about 20 minutes)")
    ap.add_argument("--quick", action="store_true", help="short run: 2 prompts, 16 tokens, K=4, HF, 1 round")
    ap.add_argument("--smoke", action="store_true",
                    help=f"--quick on the tiny model (spec_methods: with random heads): {SMOKE_HELP}")
    ap.add_argument("--lookup-only", action="store_true",
                    help="only prompt lookup (else bench/spec_methods.py's Medusa / draft comparison runs first)")
    args, rest = ap.parse_known_args()
    if not args.lookup_only:
        import spec_methods

        spec_methods.main(rest + (["--smoke"] if args.smoke else ["--quick"] if args.quick else [])
                          + (["--full"] if args.full else []))
        print(flush=True)
    elif rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    args.quick = args.quick or args.smoke
    if args.smoke:
        tiny_model()
    if args.quick:
        args.ks, args.new_tokens, args.rounds, args.prompts, args.hf = "4", 16, 1, 2, True
    if args.full:
        args.ks, args.hf, args.full_warmup = args.ks or "2,3,4,5,8", True, True
        args.prompts, args.rounds = len(PROMPTS), 3
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()

    def elapsed() -> str:
        return f"[{time.perf_counter() - t_start:.0f} s]"

    from loramux.engine.engine import LLMEngine
    from loramux.engine.sampling.params import SamplingParams
    from loramux.settings import Settings

    default_k = args.default_k if args.default_k is not None else Settings().speculative_tokens
    ks = sorted({int(k) for k in (args.ks or str(default_k)).split(",")} | {default_k})
    hf_ks = [int(k) for k in (args.hf_ks or str(default_k)).split(",")] if args.hf and not args.skip_hf else []

    engine = LLMEngine.from_settings(Settings(dtype="float32", device="cpu", prefix_caching=False,
                                              speculative_tokens=default_k))
    tok = engine.tokenizer
    eos_ids = sorted(engine.eos_token_ids)
    prompts = [chat_ids(engine, text, instr) for text, instr in PROMPTS[: args.prompts]]
    hf = None
    if hf_ks:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(tok.name_or_path, dtype=torch.float32).eval()
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else eos_ids[0]
    print(describe_cpu())
    print(f"model {model_label(args.smoke)} float32, threads={args.threads}, batch 1, greedy, until end-of-turn or "
          f"{args.new_tokens} new tokens, {len(prompts)} summarisation/extraction prompts of "
          f"{min(map(len, prompts))}-{max(map(len, prompts))} tokens, rounds={args.rounds} (median), "
          f"{time.strftime('%Y-%m-%d')}, load {time.perf_counter() - t_start:.1f} s", flush=True)

    def run_loramux(k: int):
        """One configuration over one prompt -> (token ids, seconds, seconds of each engine step, proposed,
        accepted)."""
        def run(ids: list[int]):
            engine.config.speculative_tokens = k
            params = SamplingParams(max_tokens=args.new_tokens, speculative=k > 0)
            before = engine.stats()
            rid = f"spec-{time.monotonic_ns()}"
            t0 = time.perf_counter()
            engine.add_request(rid, ids, params)
            step_s, final = [], None
            while engine.has_unfinished():
                t_step = time.perf_counter()
                for out in engine.step():
                    if out.finished:
                        final = out
                step_s.append(time.perf_counter() - t_step)
            dt = time.perf_counter() - t0
            after = engine.stats()
            return (final.token_ids, dt, step_s, after["spec_proposed_tokens"] - before["spec_proposed_tokens"],
                    after["spec_accepted_tokens"] - before["spec_accepted_tokens"])
        return run

    def run_hf(k: int | None):
        def run(ids: list[int]):
            inputs = torch.tensor([ids])
            extra = {"prompt_lookup_num_tokens": k} if k else {}
            t0 = time.perf_counter()
            with torch.inference_mode():
                out = hf.generate(input_ids=inputs, attention_mask=torch.ones_like(inputs),
                                  max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=eos_ids,
                                  pad_token_id=pad_id, **extra)
            dt = time.perf_counter() - t0
            row = out[0, inputs.shape[1]:].tolist()
            row = row[: next((i + 1 for i, t in enumerate(row) if t in eos_ids), len(row))]
            return row, dt, None, None, None
        return run

    configs = {"loramux no spec": run_loramux(0)}
    configs.update({f"loramux K={k}": run_loramux(k) for k in ks})
    if hf_ks:
        configs["HF generate"] = run_hf(None)
        configs.update({f"HF lookup K={k}": run_hf(k) for k in hf_ks})
    names = list(configs)

    def check(name: str, i: int, got: list[int]) -> None:
        want = reference[i]
        if got == want:
            return
        at = first_difference(want, got)
        msg = (f"{name} differs from loramux without speculation on prompt {i} ({PROMPTS[i][1]!r}) at output "
               f"position {at} of {len(want)}/{len(got)}: {want[at:at + 5]} vs {got[at:at + 5]} "
               f"({tok.decode(want[max(0, at - 8):at])!r} | {tok.decode(want[at:at + 4])!r} vs "
               f"{tok.decode(got[at:at + 4])!r})")
        if name.startswith("loramux"):
            sys.exit(f"ENGINE BUG: {msg}")
        print(f"WARNING: {msg}", flush=True)

    def run_prompt(i: int, order: list[str]) -> dict[str, tuple]:
        """Every configuration in `order` once on prompt i; the outputs are checked against loramux without
        speculation (the first time it ran on this prompt)."""
        results = {name: configs[name](prompts[i]) for name in order}
        reference.setdefault(i, results["loramux no spec"][0])
        for name in order:
            check(name, i, results[name][0])
        return results

    # Warm-up: every configuration once on the first prompt (--full-warmup: on every prompt); outputs checked.
    reference: dict[int, list[int]] = {}
    t0 = time.perf_counter()
    for i in range(len(prompts) if args.full_warmup else 1):
        run_prompt(i, names)
        print(f"  warm-up prompt {i + 1} ({len(reference[i])} tokens) {elapsed()}", flush=True)
    print(f"warm-up ({'every prompt' if args.full_warmup else 'first prompt'}, {len(names)} configurations) "
          f"{time.perf_counter() - t0:.1f} s {elapsed()}", flush=True)

    tps = {name: [] for name in names}  # per round: tokens / seconds over all prompts
    secs = {name: [[] for _ in prompts] for name in names}  # per prompt: seconds of each round
    spec = {name: [0, 0, 0, 0] for name in names if name.startswith("loramux K")}  # proposed, accepted, tokens, steps
    step_ms = {name: [] for name in names if name.startswith("loramux")}  # decode / verification steps
    for r in range(args.rounds):
        t_round = time.perf_counter()
        load = open_loadavg()
        for i in range(len(prompts)):
            shift = (r + i) % len(names)
            order = names[shift:] + names[:shift]
            results = run_prompt(i, order)
            for name in order:
                got, dt, step_s, proposed, accepted = results[name]
                secs[name][i].append(dt)
                if name in step_ms:
                    step_ms[name] += [1000 * x for x in step_s[1:]]  # the prefill step makes the first token
                if name in spec:
                    s = spec[name]
                    s[0] += proposed
                    s[1] += accepted
                    s[2] += len(got) - 1
                    s[3] += len(step_s) - 1
            print(f"  round {r + 1}/{args.rounds} prompt {i + 1}/{len(prompts)} ({len(reference[i])} tokens): "
                  + ", ".join(f"{n} {secs[n][i][-1]:.1f} s" for n in order) + f" {elapsed()}", flush=True)
        n_tokens = sum(len(o) for o in reference.values())
        for name in names:
            tps[name].append(n_tokens / sum(s[-1] for s in secs[name]))
        print(f"round {r + 1}/{args.rounds}: {time.perf_counter() - t_round:.1f} s, load average {load} -> "
              f"{open_loadavg()}  " + "  ".join(f"{n} {tps[n][-1]:.1f}" for n in names) + f" {elapsed()}",
              flush=True)
    outputs = [reference[i] for i in range(len(prompts))]

    # Headline tok/s: all tokens / the sum over prompts of each prompt's median time over rounds (robust to
    # a round that another job on this shared machine slowed down).
    med = {name: n_tokens / sum(statistics.median(s) for s in secs[name]) for name in names}
    base = med["loramux no spec"]
    print(f"\n{n_tokens} generated tokens per configuration and round "
          f"({min(len(o) for o in outputs)}-{max(len(o) for o in outputs)} "
          f"per prompt)")
    print(f"{'configuration':18s} {'tok/s':>7s} {'x no spec':>9s} {'accept':>7s} {'tok/step':>8s} {'ms/step':>7s}"
          "  rounds (tok/s)")
    for name in names:
        extra = " " * 25
        if name in step_ms:
            proposed, accepted, decoded, steps = spec.get(name, [0, 0, 1, 1])
            rate = f"{accepted / max(proposed, 1):7.1%}" if name in spec else " " * 7
            extra = f"{rate} {decoded / max(steps, 1):8.2f} {statistics.median(step_ms[name]):7.1f}"
        ref = med["HF generate"] if name.startswith("HF") else base
        print(f"{name:18s} {med[name]:7.1f} {med[name] / ref:9.2f} {extra}  {[round(x, 1) for x in tps[name]]}")
    if hf_ks:
        print("(HF rows: 'x no spec' is relative to HF generate without prompt lookup; "
              f"loramux no spec / HF generate = {base / med['HF generate']:.2f})")
        for k in hf_ks:
            print(f"loramux K={k} / HF lookup K={k} = {med[f'loramux K={k}'] / med[f'HF lookup K={k}']:.2f}")
    best = max(ks, key=lambda k: med[f"loramux K={k}"])
    print(f"best K: {best} ({med[f'loramux K={best}'] / base:.2f}x); FIGURE uses K={default_k}; "
          f"total {time.perf_counter() - t_start:.0f} s")
    print(f"FIGURE spec_speedup {med[f'loramux K={default_k}'] / base:.2f}")


if __name__ == "__main__":
    main()
