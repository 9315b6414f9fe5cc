"""The server's own counters for bench/serve_load.py: /metrics (Prometheus text) before and after a window, and
the differences that matter, per engine.

loramux: request outcomes (loramux_requests_total by outcome), tokens by kind, the queue / TTFT / inter-token
histograms and, where the engine exports them, the step histograms (loramux_step_seconds, loramux_step_tokens,
loramux_step_prefill_tokens), the loramux_decodes_delayed_by_prefill gauge and its counter of decode tokens.
vLLM: preemptions, prompt and generation tokens, finished requests by reason, its TTFT / inter-token / queue /
iteration-token histograms, the ones that exist in the version run. Histograms become count, mean and the bucket
bounds holding p50 and p99 of the window (bucket deltas). Best effort: a family that is absent is left out; a
scrape that fails yields {}.
"""
from __future__ import annotations

import math

LORAMUX = {
    "counters": {"requests": ("loramux_requests_total", "outcome"), "tokens": ("loramux_tokens_total", "kind"),
                 "decode_tokens_delayed_by_prefill": ("loramux_decode_tokens_delayed_by_prefill_total", None)},
    "histograms": ("loramux_queue_seconds", "loramux_ttft_seconds", "loramux_inter_token_seconds",
                   "loramux_step_seconds", "loramux_step_tokens", "loramux_step_prefill_tokens"),
    "gauges": ("loramux_decodes_delayed_by_prefill",),
}
VLLM = {
    "counters": {"preemptions": ("vllm:num_preemptions_total", None),
                 "prompt_tokens": ("vllm:prompt_tokens_total", None),
                 "generation_tokens": ("vllm:generation_tokens_total", None),
                 "requests": ("vllm:request_success_total", "finished_reason")},
    "histograms": ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                   "vllm:time_per_output_token_seconds", "vllm:request_queue_time_seconds",
                   "vllm:iteration_tokens_total", "vllm:e2e_request_latency_seconds"),
    "gauges": (),
}
SPECS = {"loramux": LORAMUX, "vllm": VLLM}

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> Samples:
    """Every sample of a Prometheus text page: (sample name, sorted labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    out: Samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _sum(samples: Samples, name: str, by: str | None = None) -> dict[str, float]:
    """Values of sample `name`, summed over all labels but `by` ({"": total} when `by` is None)."""
    out: dict[str, float] = {}
    for (sample, labels), value in samples.items():
        if sample == name:
            key = dict(labels).get(by, "?") if by else ""
            out[key] = out.get(key, 0.0) + value
    return out


def _buckets(samples: Samples, name: str) -> dict[float, float]:
    out: dict[float, float] = {}
    for (sample, labels), value in samples.items():
        if sample == name + "_bucket":
            le = float(dict(labels)["le"])
            out[le] = out.get(le, 0.0) + value
    return out


def bucket_pct(buckets: dict[float, float], q: float) -> float:
    """Upper bound of the bucket holding the q-th percentile of cumulative `buckets` (inf above the last bound)."""
    ordered = sorted(buckets.items())
    if not ordered or ordered[-1][1] <= 0:
        return math.nan
    total = ordered[-1][1]
    return next(le for le, count in ordered if count >= q / 100 * total)


def histogram_delta(before: Samples, after: Samples, name: str) -> dict | None:
    """count, mean, p50 / p99 (bucket bounds) of what histogram `name` observed between two scrapes."""
    b_after = _buckets(after, name)
    if not b_after:
        return None
    b_before = _buckets(before, name)
    delta = {le: v - b_before.get(le, 0.0) for le, v in b_after.items()}
    count = sum(_sum(after, name + "_count").values()) - sum(_sum(before, name + "_count").values())
    total = sum(_sum(after, name + "_sum").values()) - sum(_sum(before, name + "_sum").values())
    return {"count": count, "mean": total / count if count else math.nan,
            "p50_le": bucket_pct(delta, 50), "p99_le": bucket_pct(delta, 99)}


def server_counters(engine: str, before: Samples, after: Samples, error: str | None = None) -> dict:
    """The per-engine numbers of one window (after - before), best effort; {"scrape_error": ...} without a scrape."""
    spec, out = SPECS.get(engine.partition("@")[0]), {}  # vllm@N: a vLLM variant
    if error or not after:
        return {"scrape_error": error or "empty /metrics"}
    if spec is None:
        return out
    for key, (name, by) in spec["counters"].items():
        values = _sum(after, name, by)
        if values:
            prev = _sum(before, name, by)
            diff = {k: v - prev.get(k, 0.0) for k, v in values.items()}
            out[key] = diff[""] if by is None else {k: v for k, v in sorted(diff.items()) if v}
    for name in spec["histograms"]:
        hist = histogram_delta(before, after, name)
        if hist is not None:
            out[name] = hist
    for name in spec["gauges"]:
        values = _sum(after, name)
        if values:
            out[name] = {"after": values[""], "delta": values[""] - _sum(before, name).get("", 0.0)}
    return out


async def scrape(client, url: str) -> tuple[Samples, str | None]:
    """/metrics of the server at `url`, parsed, and None; or {} and why not (never raises)."""
    try:
        resp = await client.get(url + "/metrics", timeout=10, follow_redirects=True)  # vLLM: /metrics -> /metrics/
        resp.raise_for_status()
        return parse(resp.text), None
    except Exception as exc:  # noqa: BLE001 - the server's own view is a bonus, never a reason to fail the run
        return {}, f"{type(exc).__name__}: {exc}"[:200]


def brief(engine: str, counters: dict) -> str:
    """One line of the most telling counters."""
    if not counters or "scrape_error" in counters:
        return f"(no /metrics: {counters.get('scrape_error', 'nothing known')})"
    parts = []
    if isinstance(counters.get("requests"), dict):
        parts.append("requests " + ", ".join(f"{k} {v:g}" for k, v in counters["requests"].items()))
    if "preemptions" in counters:
        parts.append(f"preemptions {counters['preemptions']:g}")
    for name, label in (("loramux_queue_seconds", "queue"), ("vllm:request_queue_time_seconds", "queue"),
                        ("vllm:iteration_tokens_total", "step tokens"),
                        ("loramux_step_seconds", "step"), ("loramux_step_tokens", "step tokens")):
        h = counters.get(name)
        if h and h["count"]:
            scale, unit = (1000, " ms") if name.endswith("seconds") else (1, "")
            parts.append(f"{label} mean {h['mean'] * scale:.0f}{unit} (p99 <= {h['p99_le'] * scale:g}{unit})")
    if "decode_tokens_delayed_by_prefill" in counters:
        parts.append(f"decode tokens delayed by prefill {counters['decode_tokens_delayed_by_prefill']:g}")
    return "; ".join(parts)
