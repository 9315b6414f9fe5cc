"""Prefix caching: time to first token with a 512-token shared prefix cached vs computed, loramux vs HF.

Every prompt is one fixed 512-token prefix (a long system prompt, real English text cut to exactly 512
tokens by the model's tokenizer) followed by a 32-token suffix (a seeded "Customer: ..." line of words
drawn from a small vocabulary) that no other prompt uses: every measurement gets a fresh suffix, so only
the shared prefix can ever be a cache hit. Batch 1, greedy, one new token: TTFT = submit to the first
sampled token, the wall clock around the whole call, on every path.

  * loramux cached   - an engine with prefix caching on (default settings otherwise); the prefix was
                       primed once by one request of the prefix alone; every measured prompt must report
                       num_cached_tokens == 512 (all 32 full 16-token blocks of the prefix; the suffix's
                       own blocks are new, and the last prompt token is always recomputed anyway).
  * loramux uncached - the same engine, the same prompt, but a cache salt of its own for every request,
                       so no block can match (num_cached_tokens == 0): the same weights and the same step
                       token budget; the only extra work against an engine with caching off is hashing
                       34 blocks. With the default max_num_batched_tokens 512, a 544-token prompt
                       prefills in two steps (512 + 32 tokens).
  * HF uncached      - one forward of all 544 tokens (use_cache=True, logits_to_keep=1, as `generate`'s
                       prefill does), then argmax.
  * HF cached        - the prefix's KV cache (a DynamicCache; transformers 5 calls the argument `cache`,
                       formerly `past_key_values`) computed once up front; per prompt: forward only the 32
                       suffix tokens on that cache, argmax, then `cache.crop(-32)` (negative = tokens to
                       remove) to put it back to the bare prefix for the next prompt. The crop is timed
                       as part of the cached TTFT. It is cheaper than a `copy.deepcopy` of the cache before
                       each use (also timed and printed) and equally correct: DynamicCache appends with
                       torch.cat, so the forward never writes into the prefix's tensors (checked: the
                       first tokens of all four paths agree).

Same weights (float32), same token ids, same thread count on both sides; every path warmed up on two
prompts not measured (one in --quick); within a round the four measurements of each prompt run back to
back in an order that rotates from prompt to prompt; medians over all prompts are reported, and the
median of each round is printed.
"""
from __future__ import annotations

import argparse
import copy
import os
import random
import statistics
import time

import torch
from smoke import SMOKE_HELP, model_label, tiny_model

from loramux.testing import describe_cpu

PREFIX_LEN = 512
SUFFIX_LEN = 32

SYSTEM_PROMPT = """\
You are the support assistant of Northwind Outfitters, a company that sells outdoor clothing, tents,
sleeping bags and climbing equipment through its online shop and twelve stores across the country.
Read this whole document before you answer; it is the only source of company policy you may rely on.

Tone and style. Be friendly, brief and precise. Address the customer by name when it is known. Never
invent order numbers, prices, delivery dates or stock levels: when you do not know something, say so and
explain how the customer can find out. Write in plain language, avoid jargon, and do not use more than
three short paragraphs unless the customer asks for detail. Do not discuss competitors' products.

Orders and delivery. Standard delivery takes three to five working days and is free for orders above
fifty euros; below that it costs four euros ninety. Express delivery arrives the next working day when
the order is placed before two in the afternoon and costs nine euros ninety. Orders can be changed or
cancelled free of charge until they are handed to the carrier; after that, the customer must wait for
the parcel and return it. Parcels that cannot be delivered are kept at the nearest pickup point for
seven days and then sent back to our warehouse, and the customer is refunded minus the delivery fee.

Returns and refunds. Unused items in their original packaging can be returned within sixty days of
delivery. Returns by post are free with the label printed from the customer's account; returns in a
store are always accepted with the receipt or the order confirmation. Refunds go back to the original
payment method within five working days of the return reaching us. Gift cards and personalised items
cannot be returned. Sleeping bags and mattresses that were used outdoors can only be returned under the
warranty, not as a change of mind.

Warranty and repairs. All products carry a two-year warranty against manufacturing defects. Tents,
backpacks and jackets of our own brand carry a lifetime warranty on seams and zips. The customer should
send a photo of the defect through the repair form; our workshop decides within three working days
whether the item is repaired, replaced or refunded. Normal wear, accidents and misuse are not covered,
but the workshop offers paid repairs at fixed prices listed on the repair page.

Safety. For questions about climbing ropes, harnesses, helmets and avalanche equipment, give only the
manufacturer's published guidance and always recommend training with a certified instructor. Never tell
a customer that a piece of safety equipment that was dropped, overloaded or is older than its stated
lifetime is still safe to use.

Escalation. Hand the conversation to a human agent when the customer asks for one, when a payment
failed twice, when a parcel is reported stolen, or when the customer is upset after two answers.
"""

SUFFIX_WORDS = """order parcel jacket tent return refund size colour warranty zip seam delivery express store
receipt boots rope helmet harness backpack sleeping bag mattress gift card voucher cancel change address
invoice payment failed twice stolen damaged repair photo workshop winter summer mountain trip weekend
tomorrow yesterday week month price discount member account password email phone please thanks why when
how where which can could would should my our the a an is was will not still already again""".split()


def build_prefix(tok) -> list[int]:
    ids = tok.encode(SYSTEM_PROMPT, add_special_tokens=False)
    if len(ids) < PREFIX_LEN:
        raise SystemExit(f"the system prompt has only {len(ids)} tokens; need {PREFIX_LEN}")
    return ids[:PREFIX_LEN]


def build_suffixes(tok, n: int, seed: int) -> list[list[int]]:
    """`n` distinct 32-token customer questions (seeded word salad, tokenised, cut to 32 tokens)."""
    rng = random.Random(seed)
    out, seen = [], set()
    while len(out) < n:
        text = "\n\nCustomer: " + " ".join(rng.choice(SUFFIX_WORDS) for _ in range(40)) + "?"
        ids = tuple(tok.encode(text, add_special_tokens=False)[:SUFFIX_LEN])
        if len(ids) == SUFFIX_LEN and ids not in seen:
            seen.add(ids)
            out.append(list(ids))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=None, help="rounds (default 3; --full: 5)")
    ap.add_argument("--prompts-per-round", type=int, default=8, help="fresh suffixes per round")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--max-batched-tokens", type=int, default=None,
                    help="engine step token budget (default: Settings' max_num_batched_tokens)")
    ap.add_argument("--quick", action="store_true", help="smoke mode: 1 round of 3 prompts, one warm-up prompt")
    ap.add_argument("--full", action="store_true", help="the long run: 5 rounds")
    ap.add_argument("--smoke", action="store_true", help=f"--quick on the tiny model: {SMOKE_HELP}")
    args = ap.parse_args()
    if args.rounds is None:
        args.rounds = 5 if args.full else 3
    args.quick = args.quick or args.smoke
    if args.quick:
        args.rounds, args.prompts_per_round = 1, 3
    if args.smoke:
        tiny_model()
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()

    from transformers import AutoModelForCausalLM
    from transformers.cache_utils import DynamicCache

    from loramux.engine.engine import LLMEngine
    from loramux.engine.sampling.params import SamplingParams
    from loramux.settings import Settings

    settings = Settings(dtype="float32", device="cpu", prefix_caching=True,
                        **({"max_num_batched_tokens": args.max_batched_tokens} if args.max_batched_tokens else {}))
    engine = LLMEngine.from_settings(settings, load_adapters=False)
    tok = engine.tokenizer
    hf = AutoModelForCausalLM.from_pretrained(tok.name_or_path, dtype=torch.float32).eval()
    params = SamplingParams(max_tokens=1, temperature=0.0)

    prefix = build_prefix(tok)
    n_prompts = args.rounds * args.prompts_per_round
    n_warm = 1 if args.quick else 2
    suffixes = build_suffixes(tok, n_warm + n_prompts, args.seed)
    prompts = [prefix + s for s in suffixes]
    print(describe_cpu())
    print(f"model {model_label(args.smoke)} float32, threads={args.threads}, prompt = {PREFIX_LEN}-token shared "
          f"prefix + {SUFFIX_LEN}-token suffix, batch 1, 1 greedy token; {args.rounds} rounds x "
          f"{args.prompts_per_round} prompts (every suffix used once), block_size {settings.block_size}, "
          f"max_num_batched_tokens {settings.max_num_batched_tokens}, {time.strftime('%Y-%m-%d')}")
    print(f"setup (engine + HF load) {time.perf_counter() - t_start:.1f} s; load average before the run "
          f"{os.getloadavg()[0]:.2f}", flush=True)

    counter = iter(range(10**9))

    def engine_ttft(ids: list[int], salt: str | None) -> tuple[float, int, int]:
        """Submit one request and step until its first token: (seconds, token, num_cached_tokens)."""
        rid = f"p{next(counter)}"
        t0 = time.perf_counter()
        engine.add_request(rid, ids, params, cache_salt=salt)
        while True:
            for out in engine.step():
                if out.request_id == rid and out.token_ids:
                    dt = time.perf_counter() - t0
                    while engine.has_unfinished():  # nothing left with max_tokens=1; kept for safety
                        engine.step()
                    return dt, out.token_ids[0], out.num_cached_tokens

    def lm_cached(ids):
        return engine_ttft(ids, None)

    def lm_uncached(ids):
        return engine_ttft(ids, f"uncached-{next(counter)}")  # a namespace of its own: nothing can match

    with torch.inference_mode():
        prefix_cache = hf(input_ids=torch.tensor([prefix]), use_cache=True).cache
    assert isinstance(prefix_cache, DynamicCache) and prefix_cache.get_seq_length() == PREFIX_LEN

    def hf_uncached(ids):
        t0 = time.perf_counter()
        with torch.inference_mode():
            logits = hf(input_ids=torch.tensor([ids]), use_cache=True, logits_to_keep=1).logits
        token = int(logits[0, -1].argmax())
        return time.perf_counter() - t0, token, 0

    def hf_cached(ids):
        t0 = time.perf_counter()
        with torch.inference_mode():
            logits = hf(input_ids=torch.tensor([ids[PREFIX_LEN:]]), cache=prefix_cache, use_cache=True,
                        logits_to_keep=1).logits
        token = int(logits[0, -1].argmax())
        prefix_cache.crop(PREFIX_LEN - prefix_cache.get_seq_length())  # drop the suffix: back to the bare prefix
        dt = time.perf_counter() - t0
        assert prefix_cache.get_seq_length() == PREFIX_LEN
        return dt, token, PREFIX_LEN

    # Prime loramux's cache with the prefix alone (its 32 full blocks are committed after the prefill).
    _, _, primed = engine_ttft(prefix, None)
    assert primed == 0, primed
    # Warm-up: every path once on prompts not used below.
    for fn in (lm_cached, lm_uncached, hf_cached, hf_uncached):
        for ids in prompts[:n_warm]:
            fn(ids)
    # The crop alternative: what a deepcopy of the prefix cache would cost per prompt instead.
    copy_s = []
    for _ in range(5):
        t0 = time.perf_counter()
        copy.deepcopy(prefix_cache)
        copy_s.append(time.perf_counter() - t0)
    print(f"primed and warmed up [{time.perf_counter() - t_start:.0f} s]", flush=True)

    paths = {"loramux cached": lm_cached, "loramux uncached": lm_uncached,
             "HF cached": hf_cached, "HF uncached": hf_uncached}
    names = list(paths)
    times: dict[str, list[float]] = {n: [] for n in names}
    round_medians: dict[str, list[float]] = {n: [] for n in names}
    cached_counts = {n: set() for n in names}
    tokens_agree = 0
    t_meas = time.perf_counter()
    for r in range(args.rounds):
        this_round = {n: [] for n in names}
        for j in range(args.prompts_per_round):
            k = r * args.prompts_per_round + j
            ids = prompts[n_warm + k]
            order = names[k % 4:] + names[:k % 4]  # rotate who goes first
            firsts = {}
            for name in order:
                dt, token, cached = paths[name](ids)
                this_round[name].append(dt)
                firsts[name] = token
                cached_counts[name].add(cached)
            tokens_agree += len(set(firsts.values())) == 1
        for n in names:
            times[n].extend(this_round[n])
            round_medians[n].append(statistics.median(this_round[n]))
        print(f"round {r + 1}/{args.rounds}: " + "  ".join(f"{n} {1e3 * round_medians[n][-1]:.0f} ms" for n in names)
              + f"  (load average {os.getloadavg()[0]:.2f}) [{time.perf_counter() - t_start:.0f} s]", flush=True)
    measure_s = time.perf_counter() - t_meas

    assert cached_counts["loramux cached"] == {PREFIX_LEN}, cached_counts["loramux cached"]
    assert cached_counts["loramux uncached"] == {0}, cached_counts["loramux uncached"]
    med = {n: 1e3 * statistics.median(v) for n, v in times.items()}
    lm_ratio = med["loramux cached"] / med["loramux uncached"]
    hf_ratio = med["HF cached"] / med["HF uncached"]

    print()
    print(f"TTFT, median of {n_prompts} prompts (ms):")
    print("| peer | cached (512 of 544 tokens reused) | uncached (544 computed) | cached / uncached |")
    print("|---|---|---|---|")
    print(f"| loramux | {med['loramux cached']:.1f} | {med['loramux uncached']:.1f} | {lm_ratio:.3f} |")
    print(f"| HF transformers (past_key_values + crop) | {med['HF cached']:.1f} | {med['HF uncached']:.1f} "
          f"| {hf_ratio:.3f} |")
    print(f"loramux num_cached_tokens: cached {sorted(cached_counts['loramux cached'])}, "
          f"uncached {sorted(cached_counts['loramux uncached'])}")
    print(f"first tokens identical on all four paths: {tokens_agree}/{n_prompts} prompts")
    print(f"HF: deepcopy of the 512-token DynamicCache would cost {1e3 * statistics.median(copy_s):.1f} ms per "
          f"prompt (median of 5); the crop used instead is included in HF cached")
    print(f"loramux cached vs HF cached: {med['loramux cached'] / med['HF cached']:.2f}x the time; uncached "
          f"{med['loramux uncached'] / med['HF uncached']:.2f}x")
    print(f"load average after the run {os.getloadavg()[0]:.2f}; measured in {measure_s:.1f} s, "
          f"total {time.perf_counter() - t_start:.1f} s")
    print(f"hf_prefix_ttft_ratio {hf_ratio:.3f}")
    print(f"FIGURE prefix_ttft_ratio {lm_ratio:.3f}")


if __name__ == "__main__":
    main()
