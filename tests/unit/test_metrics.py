"""Server metrics (Prometheus text, private registries, bounded labels) and JSON logs."""
from __future__ import annotations

import io
import json
import logging
import math
import threading
import time
from datetime import datetime

import pytest
from prometheus_client.parser import text_string_to_metric_families

from loramux.histogram import DurationHistogram
from loramux.server.http.logs import NOISY_LOGGERS, JsonFormatter, configure_logging, request_id_var
from loramux.server.serving.metrics import CACHE_LEVELS, LORA_INFO, LORA_INFO_LABELS, OUTCOMES, ServerMetrics
from loramux.server.serving.vllm_metrics import CACHE_CONFIG_INFO

ALLOWED_LABELS = {"tier", "outcome", "kind", "cache_tier", "le", "method"}


def samples(metrics: ServerMetrics) -> list:
    body, content_type = metrics.render()
    assert content_type.startswith("text/plain")
    return [s for fam in text_string_to_metric_families(body.decode()) for s in fam.samples]


def value(metrics: ServerMetrics, name: str, **labels) -> float | None:
    """The value of the sample `name` whose labels are exactly `labels` (None if absent)."""
    found = [s.value for s in samples(metrics) if s.name == name and s.labels == labels]
    assert len(found) <= 1
    return found[0] if found else None


# -- request metrics -----------------------------------------------------------------------------------
def test_observe_finished_counts_and_histograms():
    m = ServerMetrics()
    m.observe_finished(tier="premium", outcome="stop", queue_s=0.02, ttft_s=0.2, e2e_s=1.5,
                       prompt_tokens=100, cached_tokens=64, completion_tokens=20)
    m.observe_finished(tier="premium", outcome="timeout", queue_s=None, ttft_s=None, e2e_s=30.0,
                       prompt_tokens=10, cached_tokens=0, completion_tokens=0)

    assert value(m, "loramux_requests_total", tier="premium", outcome="stop") == 1
    assert value(m, "loramux_requests_total", tier="premium", outcome="timeout") == 1
    assert value(m, "loramux_requests_total", tier="free", outcome="stop") == 0  # pre-created series
    assert value(m, "loramux_e2e_seconds_count", tier="premium") == 2
    assert value(m, "loramux_e2e_seconds_sum", tier="premium") == pytest.approx(31.5)
    assert value(m, "loramux_queue_seconds_count", tier="premium") == 1  # None = not observed
    assert value(m, "loramux_ttft_seconds_count", tier="premium") == 1
    assert value(m, "loramux_ttft_seconds_bucket", tier="premium", le="0.1") == 0
    assert value(m, "loramux_ttft_seconds_bucket", tier="premium", le="0.25") == 1
    assert value(m, "loramux_ttft_seconds_bucket", tier="premium", le="0.005") == 0
    assert value(m, "loramux_e2e_seconds_bucket", tier="premium", le="120.0") == 2
    assert value(m, "loramux_ttft_seconds_count", tier="free") == 0
    assert value(m, "loramux_tokens_total", kind="prompt") == 110
    assert value(m, "loramux_tokens_total", kind="cached") == 64
    assert value(m, "loramux_tokens_total", kind="completion") == 20


def test_inter_token_and_rejected():
    m = ServerMetrics()
    for gap in (0.0005, 0.012, 0.012, 7.0):
        m.observe_inter_token(gap, "standard")
    m.count_rejected("free", "rate_limited")
    m.count_rejected("free", "rejected")
    m.count_rejected("free", "rejected")

    assert value(m, "loramux_inter_token_seconds_count", tier="standard") == 4
    assert value(m, "loramux_inter_token_seconds_bucket", tier="standard", le="0.001") == 1
    assert value(m, "loramux_inter_token_seconds_bucket", tier="standard", le="0.015") == 3
    assert value(m, "loramux_inter_token_seconds_bucket", tier="standard", le="5.0") == 3
    assert value(m, "loramux_requests_total", tier="free", outcome="rate_limited") == 1
    assert value(m, "loramux_requests_total", tier="free", outcome="rejected") == 2
    assert value(m, "loramux_e2e_seconds_count", tier="free") == 0  # refused requests have no latency


def test_bad_inputs_never_raise():
    m = ServerMetrics()
    m.observe_finished(tier=None, outcome=None, queue_s=float("nan"), ttft_s=-1.0, e2e_s="soon",
                       prompt_tokens=-5, cached_tokens=None, completion_tokens=3)
    m.observe_inter_token(float("inf"), "free")
    assert value(m, "loramux_requests_total", tier="other", outcome="other") == 1
    assert value(m, "loramux_queue_seconds_count", tier="other") == 0
    assert value(m, "loramux_ttft_seconds_count", tier="other") == 1  # negative clamped to 0
    assert value(m, "loramux_e2e_seconds_count", tier="other") == 0
    assert value(m, "loramux_tokens_total", kind="prompt") == 0
    assert value(m, "loramux_tokens_total", kind="completion") == 3
    assert value(m, "loramux_inter_token_seconds_count", tier="free") == 0


def test_unknown_labels_map_to_other_and_cardinality_stays_bounded():
    tiers = ("free", "standard", "premium")
    m = ServerMetrics(tiers)
    for i in range(1000):
        bogus = f"tenant-{i}"
        m.observe_finished(tier=bogus, outcome=f"weird-{i}", queue_s=0.01, ttft_s=0.02, e2e_s=0.5,
                           prompt_tokens=1, cached_tokens=0, completion_tokens=1)
        m.observe_inter_token(0.01, bogus)
        m.count_rejected(bogus, "429")
    m.observe_finished(tier="free", outcome="bogus", queue_s=0.01, ttft_s=0.02, e2e_s=0.5,
                       prompt_tokens=1, cached_tokens=0, completion_tokens=1)

    assert value(m, "loramux_requests_total", tier="other", outcome="other") == 2000
    assert value(m, "loramux_requests_total", tier="free", outcome="other") == 1
    assert value(m, "loramux_inter_token_seconds_count", tier="other") == 1000
    all_samples = samples(m)
    tier_values = {s.labels["tier"] for s in all_samples if "tier" in s.labels}
    assert tier_values == {*tiers, "other"}
    outcome_values = {s.labels["outcome"] for s in all_samples if "outcome" in s.labels}
    assert outcome_values == {*OUTCOMES, "other"}
    for s in all_samples:
        assert set(s.labels) <= ALLOWED_LABELS, s
        assert s.name.startswith("loramux_"), s.name
    assert len(all_samples) < 400  # fixed series count, independent of how many tenants were seen


def test_custom_tiers():
    m = ServerMetrics(tiers=["gold"])
    m.count_rejected("gold", "error")
    m.count_rejected("free", "error")
    assert value(m, "loramux_requests_total", tier="gold", outcome="error") == 1
    assert value(m, "loramux_requests_total", tier="other", outcome="error") == 1
    assert value(m, "loramux_requests_total", tier="free", outcome="error") is None
    with pytest.raises(TypeError):
        ServerMetrics(tiers="free")


def test_instances_do_not_share_state():
    a, b = ServerMetrics(), ServerMetrics()
    a.observe_finished(tier="free", outcome="stop", queue_s=0.1, ttft_s=0.1, e2e_s=0.1,
                       prompt_tokens=5, cached_tokens=0, completion_tokens=5)
    a.set_state_source(lambda: {"waiting": 7})
    assert value(a, "loramux_requests_total", tier="free", outcome="stop") == 1
    assert value(b, "loramux_requests_total", tier="free", outcome="stop") == 0
    assert value(b, "loramux_tokens_total", kind="prompt") == 0
    assert value(a, "loramux_queue_depth") == 7
    assert value(b, "loramux_queue_depth") is None
    assert a.registry is not b.registry


# -- state source ----------------------------------------------------------------------------------------
def test_state_source_values_are_live():
    state = {"waiting": 3, "running": 2, "kv_blocks_used": 25, "kv_blocks_total": 100,
             "adapter_slots_pinned": 4,
             "adapter_cache": {"hits": {"ram": 10, "disk": 2, "store": 1, "bogus": 9}, "downloads": 1,
                               "load_failures": 0, "host_bytes": 4096, "disk_bytes": 8192}}
    m = ServerMetrics()
    assert value(m, "loramux_queue_depth") is None  # no source yet
    m.set_state_source(lambda: state)

    assert value(m, "loramux_queue_depth") == 3
    assert value(m, "loramux_running_requests") == 2
    assert value(m, "loramux_kv_cache_usage_ratio") == pytest.approx(0.25)
    assert value(m, "loramux_adapter_slots_pinned") == 4
    assert value(m, "loramux_adapter_cache_bytes", cache_tier="ram") == 4096
    assert value(m, "loramux_adapter_cache_bytes", cache_tier="disk") == 8192
    assert value(m, "loramux_adapter_cache_hits_total", cache_tier="ram") == 10
    assert value(m, "loramux_adapter_cache_hits_total", cache_tier="store") == 1
    assert value(m, "loramux_adapter_cache_hits_total", cache_tier="bogus") is None
    assert value(m, "loramux_adapter_cache_misses_total") == 1
    assert value(m, "loramux_adapter_load_failures_total") == 0

    state["waiting"] = 9
    state["kv_blocks_used"] = 50
    state["adapter_cache"]["hits"]["ram"] = 11
    assert value(m, "loramux_queue_depth") == 9
    assert value(m, "loramux_kv_cache_usage_ratio") == pytest.approx(0.5)
    assert value(m, "loramux_adapter_cache_hits_total", cache_tier="ram") == 11


def test_state_source_missing_keys_are_skipped():
    m = ServerMetrics()
    m.set_state_source(lambda: {"waiting": 1, "running": None, "kv_blocks_used": 3, "kv_blocks_total": 0,
                                "adapter_cache": {"hits": "nope", "host_bytes": "x", "disk_bytes": 5}})
    names = {s.name for s in samples(m)}
    assert value(m, "loramux_queue_depth") == 1
    assert value(m, "loramux_adapter_cache_bytes", cache_tier="disk") == 5
    for absent in ("loramux_running_requests", "loramux_kv_cache_usage_ratio", "loramux_adapter_slots_pinned",
                   "loramux_adapter_cache_hits_total", "loramux_adapter_cache_misses_total"):
        assert absent not in names


class ExplodingDict(dict):
    def get(self, key, default=None):
        raise RuntimeError("torn read")


@pytest.mark.parametrize("broken",
                         [lambda: 1 / 0, lambda: None, lambda: {"waiting": 1, "adapter_cache": ExplodingDict()}],
                         ids=["raises", "not-a-dict", "raises-inside"])
def test_raising_state_source_still_renders(broken, caplog):
    m = ServerMetrics()
    m.count_rejected("free", "rate_limited")
    m.set_state_source(broken)
    with caplog.at_level(logging.ERROR, logger="loramux.server.serving.metrics"):
        all_samples = samples(m)
    names = {s.name for s in all_samples}
    assert "loramux_tokens_total" in names
    assert "loramux_queue_depth" not in names
    assert value(m, "loramux_requests_total", tier="free", outcome="rate_limited") == 1
    assert value(m, "loramux_state_source_errors_total") == 3  # one per scrape, this one included
    assert any("state" in r.getMessage() and r.exc_info for r in caplog.records)


def test_state_source_can_be_replaced_and_removed():
    m = ServerMetrics()
    assert value(m, "loramux_state_source_errors_total") == 0
    m.set_state_source(lambda: 1 / 0)
    samples(m)
    assert value(m, "loramux_state_source_errors_total") == 2  # one per scrape
    m.set_state_source(lambda: {"running": 5})
    assert value(m, "loramux_running_requests") == 5
    m.set_state_source(None)
    assert value(m, "loramux_running_requests") is None


# -- adapter residency and vLLM's lora_requests_info -------------------------------------------------------
def histogram(*seconds: float) -> dict:
    hist = DurationHistogram()
    for s in seconds:
        hist.observe(s)
    return hist.snapshot()


def lora_state(**lora) -> dict:
    return {"running": 1, "waiting": 1,
            "lora": {"running": ["alpha", "beta"], "waiting": ["gamma"], "max_lora": 4, "device_adapters": 2,
                     "device_bytes": 2048, "device_budget_bytes": 8192, "loading": 1, "loads": 5, "evictions": 3,
                     "load_seconds": histogram(0.0007, 0.002, 0.003), **lora},
            "adapter_cache": {"hits": {"ram": 4, "disk": 1, "store": 2}, "downloads": 2, "load_failures": 0,
                              "host_bytes": 4096, "host_budget_bytes": 1 << 20, "host_adapters": 3,
                              "disk_bytes": 6144, "disk_budget_bytes": 1 << 30, "disk_adapters": 5,
                              "load_seconds": {"disk": histogram(0.02), "store": histogram(0.3, 1.2)}}}


def lora_info(metrics: ServerMetrics) -> list:
    return [s for s in samples(metrics) if s.name == LORA_INFO]


def test_lora_residency_families():
    m = ServerMetrics()
    m.set_state_source(lambda: lora_state())
    before = time.time()
    (info,) = lora_info(m)
    assert info.labels == {"running_lora_adapters": "alpha,beta", "waiting_lora_adapters": "gamma", "max_lora": "4"}
    assert before - 1 <= info.value <= time.time() + 1  # vLLM's value: the time of the scrape

    for tier, resident, nbytes, budget in (("device", 2, 2048, 8192), ("ram", 3, 4096, 1 << 20),
                                           ("disk", 5, 6144, 1 << 30)):
        assert value(m, "loramux_adapters_resident", cache_tier=tier) == resident
        assert value(m, "loramux_adapter_cache_bytes", cache_tier=tier) == nbytes
        assert value(m, "loramux_adapter_cache_budget_bytes", cache_tier=tier) == budget
    assert value(m, "loramux_adapters_resident", cache_tier="store") is None
    assert value(m, "loramux_adapter_device_loading") == 1
    assert value(m, "loramux_adapter_device_loads_total") == 5
    assert value(m, "loramux_adapter_device_evictions_total") == 3

    hist = "loramux_adapter_load_seconds"
    assert value(m, f"{hist}_count", cache_tier="device") == 3
    assert value(m, f"{hist}_sum", cache_tier="device") == pytest.approx(0.0057)
    assert value(m, f"{hist}_bucket", cache_tier="device", le="0.001") == 1
    assert value(m, f"{hist}_bucket", cache_tier="device", le="0.0025") == 2
    assert value(m, f"{hist}_bucket", cache_tier="device", le="+Inf") == 3
    assert value(m, f"{hist}_count", cache_tier="disk") == 1
    assert value(m, f"{hist}_count", cache_tier="store") == 2
    assert value(m, f"{hist}_bucket", cache_tier="store", le="1.0") == 1
    assert value(m, f"{hist}_sum", cache_tier="store") == pytest.approx(1.5)
    assert {s.labels["cache_tier"] for s in samples(m) if "cache_tier" in s.labels} <= set(CACHE_LEVELS)


def test_lora_info_without_adapters_has_empty_labels():
    m = ServerMetrics()
    m.set_state_source(lambda: {"lora": {"running": [], "waiting": [], "max_lora": 8}})
    (info,) = lora_info(m)
    assert info.labels == {"running_lora_adapters": "", "waiting_lora_adapters": "", "max_lora": "8"}
    m.set_state_source(lambda: {"waiting": 0})  # an engine without the "lora" dict: no gauge, nothing breaks
    assert lora_info(m) == [] and value(m, "loramux_queue_depth") == 0


def test_lora_state_with_bad_values_is_read_defensively():
    bad_histograms = [
        {"buckets": [(0.1, 2), (math.inf, 1)], "sum": 0.1, "count": 1},  # counts going down
        {"buckets": [(0.1, 1), (0.05, 1), (math.inf, 1)], "sum": 0.1, "count": 1},  # bounds not ascending
        {"buckets": [(0.1, 1)], "sum": 0.1, "count": 1},  # no +Inf bucket
        {"buckets": [(0.1, -1), (math.inf, 1)], "sum": 0.1, "count": 1},
        {"buckets": [("x", 1), (math.inf, 1)], "sum": 0.1, "count": 1},
        {"buckets": [(0.1, 1), (math.inf, 1)], "sum": float("nan"), "count": 1},
        {"buckets": [], "sum": 0.0, "count": 0},
        {"buckets": [0.1, math.inf]}, "nope", None,
    ]
    m = ServerMetrics()
    for bad in bad_histograms:
        m.set_state_source(lambda bad=bad: lora_state(
            running="alpha", waiting=[None, "", "a,b", "ok", "ok"], max_lora="many", loads=-1, evictions=None,
            device_bytes=float("inf"), load_seconds=bad))
        (info,) = lora_info(m)
        assert info.labels == {"running_lora_adapters": "", "waiting_lora_adapters": "ok", "max_lora": "0"}
        assert value(m, "loramux_adapter_load_seconds_count", cache_tier="device") is None, bad
        assert value(m, "loramux_adapter_load_seconds_count", cache_tier="store") == 2  # the other tiers stay
        for absent in ("loramux_adapter_device_loads_total", "loramux_adapter_device_evictions_total"):
            assert value(m, absent) is None
        assert value(m, "loramux_adapter_cache_bytes", cache_tier="device") is None
        assert value(m, "loramux_adapters_resident", cache_tier="device") == 2
        assert value(m, "loramux_state_source_errors_total") == 0
    m.set_state_source(lambda: {"lora": "not a dict", "adapter_cache": {"load_seconds": ["disk"]}})
    assert lora_info(m) == [] and value(m, "loramux_state_source_errors_total") == 0


def test_adapter_names_never_add_series():
    m = ServerMetrics()
    names = [f"adapter-{i}" for i in range(500)]
    m.set_state_source(lambda: lora_state(running=names[:8], waiting=names[8:]))
    first = samples(m)
    m.set_state_source(lambda: lora_state(running=names[-8:], waiting=names[:-8]))
    second = samples(m)
    assert len(first) == len(second)
    (info,) = [s for s in second if s.name == LORA_INFO]
    assert info.labels["running_lora_adapters"] == ",".join(sorted(names[-8:]))
    assert info.labels["waiting_lora_adapters"].count(",") == 491
    for s in second:  # adapter names appear in the one vLLM-compatible sample and nowhere else
        if s.name == LORA_INFO:
            assert set(s.labels) == set(LORA_INFO_LABELS)
        elif s.name.startswith("vllm:"):  # the vLLM names routers read (tests/unit/test_protocol_metrics.py)
            assert not s.labels or s.name == CACHE_CONFIG_INFO or set(s.labels) == {"le"}, s
        else:
            assert set(s.labels) <= ALLOWED_LABELS and s.name.startswith("loramux_"), s
            assert not any(v.startswith("adapter-") for v in s.labels.values()), s


def test_lora_requests_info_of_a_real_engine(tiny_dir, tokenizer, tiny_cfg, tmp_path):
    """One adapter's request runs and another's waits (one sequence per batch): the gauge a Prometheus
    scraper reads from /metrics lists exactly those adapters."""
    from conftest import make_engine
    from loramux.engine.sampling.params import SamplingParams
    from loramux.testing import write_peft_adapter

    engine = make_engine(tiny_dir, tokenizer, max_num_seqs=1, max_loras=2, max_lora_rank=8)
    for i, name in enumerate(("alpha", "beta")):
        engine.load_adapter_dir(write_peft_adapter(tmp_path / name, tiny_cfg, 4, ["q_proj", "v_proj"], seed=i), name)
    m = ServerMetrics()
    m.set_state_source(engine.stats)  # what the server passes through (plus the host cache, not needed here)
    max_lora = str(engine.stats()["lora"]["max_lora"])  # the most distinct adapters in one batch
    (info,) = lora_info(m)
    assert info.labels == {"running_lora_adapters": "", "waiting_lora_adapters": "", "max_lora": max_lora}

    params = SamplingParams(max_tokens=8, ignore_eos=True)
    engine.add_request("r-alpha", "Hello there", params, adapter="alpha")
    engine.add_request("r-beta", "Hello again", params, adapter="beta")
    (info,) = lora_info(m)
    assert info.labels == {"running_lora_adapters": "", "waiting_lora_adapters": "alpha,beta", "max_lora": max_lora}
    # Step until one request runs (the first step, unless its adapter is still being copied to the device);
    # the other waits for the one sequence a batch may hold.
    for _ in range(1000):
        engine.step()
        if engine.stats()["lora"]["running"]:
            break
    body = m.render()[0].decode()
    lines = [line for line in body.splitlines() if line.startswith(LORA_INFO)]
    assert len(lines) == 1 and lines[0].startswith(LORA_INFO + "{")  # the name as written, unquoted (classic format)
    (family,) = [f for f in text_string_to_metric_families(body) if f.name == LORA_INFO]
    assert family.type == "gauge"
    (info,) = family.samples
    lora = engine.stats()["lora"]
    assert lora["running"] == ["alpha"] and lora["waiting"] == ["beta"]  # first come, first served
    assert info.labels == {"running_lora_adapters": "alpha", "waiting_lora_adapters": "beta", "max_lora": max_lora}
    assert abs(info.value - time.time()) < 60
    assert value(m, "loramux_adapters_resident", cache_tier="device") == lora["device_adapters"] >= 1
    assert value(m, "loramux_adapter_device_loads_total") == lora["loads"] >= 1

    while engine.has_unfinished():
        engine.step()
    (info,) = lora_info(m)
    assert info.labels == {"running_lora_adapters": "", "waiting_lora_adapters": "", "max_lora": max_lora}


# -- logs ------------------------------------------------------------------------------------------------
@pytest.fixture
def json_logger():
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("loramux.test.jsonlogs")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False

    def lines() -> list[dict]:
        return [json.loads(line) for line in stream.getvalue().splitlines()]

    yield logger, lines
    logger.removeHandler(handler)
    logger.propagate = True


class Opaque:
    def __str__(self):
        return "opaque!"


def test_json_formatter_fields_and_request_id(json_logger):
    logger, lines = json_logger
    logger.info("no request yet")
    token = request_id_var.set("req-123")
    try:
        logger.warning("loaded %s in %.1f s", "ad_7", 1.25, extra={"tenant": "t1", "tokens": 42,
                                                                    "tags": ["a", "b"], "obj": Opaque()})
        logger.info("explicit", extra={"request_id": "req-override"})
    finally:
        request_id_var.reset(token)
    logger.info("after")

    first, second, third, fourth = lines()
    assert first["request_id"] is None and fourth["request_id"] is None
    assert second["request_id"] == "req-123"
    assert third["request_id"] == "req-override"
    assert second["msg"] == "loaded ad_7 in 1.2 s"
    assert second["level"] == "WARNING" and second["logger"] == "loramux.test.jsonlogs"
    assert second["tenant"] == "t1" and second["tokens"] == 42 and second["tags"] == ["a", "b"]
    assert second["obj"] == "opaque!"
    assert "args" not in second and "exc" not in second
    ts = datetime.fromisoformat(second["ts"].replace("Z", "+00:00"))
    assert ts.utcoffset().total_seconds() == 0


def test_json_formatter_request_id_per_thread_context(json_logger):
    logger, lines = json_logger

    def work(rid):
        request_id_var.set(rid)
        logger.info("in thread")

    threads = [threading.Thread(target=work, args=(f"r{i}",)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(line["request_id"] for line in lines()) == ["r0", "r1", "r2"]
    assert request_id_var.get() is None


def test_json_formatter_exception_is_one_line(json_logger):
    logger, lines = json_logger
    try:
        _ = 1 / 0
    except ZeroDivisionError:
        logger.exception("boom", extra={"level": "shadowed", "nan": float("nan")})
    (line,) = lines()
    assert line["msg"] == "boom" and line["level"] == "ERROR"
    assert "ZeroDivisionError" in line["exc"] and "Traceback" in line["exc"]
    assert line["extra_level"] == "shadowed"  # extras never overwrite the core fields
    assert line["nan"] == "nan"  # strict JSON


def test_configure_logging_is_idempotent(capsys):
    root = logging.getLogger()
    saved_handlers, saved_level = root.handlers[:], root.level
    saved_noisy = {name: logging.getLogger(name).level for name in NOISY_LOGGERS}
    try:
        configure_logging(json_logs=True, level="debug")
        configure_logging(json_logs=True, level="INFO")
        assert len(root.handlers) == 1
        assert isinstance(root.handlers[0].formatter, JsonFormatter)
        assert root.level == logging.INFO
        for name in NOISY_LOGGERS:
            assert logging.getLogger(name).level == logging.WARNING
        logging.getLogger("botocore").info("hidden")
        token = request_id_var.set("req-9")
        try:
            logging.getLogger("loramux.test").info("hello", extra={"adapter": "ad_1"})
        finally:
            request_id_var.reset(token)
        (line,) = [json.loads(x) for x in capsys.readouterr().err.splitlines()]
        assert line["msg"] == "hello" and line["request_id"] == "req-9" and line["adapter"] == "ad_1"

        configure_logging(json_logs=False)
        assert len(root.handlers) == 1
        assert not isinstance(root.handlers[0].formatter, JsonFormatter)
        logging.getLogger("loramux.test").warning("plain")
        err = capsys.readouterr().err
        assert "WARNING loramux.test [-] plain" in err
        with pytest.raises(ValueError):
            configure_logging(level="LOUD")
    finally:
        for handler in root.handlers[:]:
            root.removeHandler(handler)
        for handler in saved_handlers:
            root.addHandler(handler)
        root.setLevel(saved_level)
        for name, level in saved_noisy.items():
            logging.getLogger(name).setLevel(level)


def test_speculation_counters_per_method():
    state = {"speculation": {"ngram": {"proposed": 40, "accepted": 10, "verifications": 12},
                             "medusa": {"proposed": 30, "accepted": 21, "verifications": 10},
                             "draft": {"proposed": 0, "accepted": 0, "verifications": 0},
                             "eagle": {"proposed": 5, "accepted": 5, "verifications": 1}}}
    m = ServerMetrics()
    m.set_state_source(lambda: state)
    assert value(m, "loramux_spec_proposed_tokens_total", method="medusa") == 30
    assert value(m, "loramux_spec_accepted_tokens_total", method="medusa") == 21
    assert value(m, "loramux_spec_verifications_total", method="ngram") == 12
    assert value(m, "loramux_spec_accepted_tokens_total", method="draft") == 0
    assert value(m, "loramux_spec_proposed_tokens_total", method="eagle") is None  # fixed label set


def test_fair_share_counters_per_tenant_of_a_real_engine(tiny_dir, tokenizer):
    """Two tenants' requests run to the end: /metrics shows each tenant's virtual counter and weighted
    service, equal to its prompt tokens plus twice its output tokens (the default weights)."""
    from conftest import make_engine
    from loramux.engine.sampling.params import SamplingParams

    engine = make_engine(tiny_dir, tokenizer)
    m = ServerMetrics()
    m.set_state_source(engine.stats)
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    prompts = {"tn_a": [1, 2, 3, 4, 5, 6, 7], "tn_b": [9, 8, 7]}
    for tenant, prompt in prompts.items():
        engine.add_request(f"r-{tenant}", prompt, params, tenant=tenant, share_weight=1.0)
    while engine.has_unfinished():
        engine.step()
    for tenant, prompt in prompts.items():
        assert value(m, "loramux_fair_share_service_tokens_total", tenant=tenant) == len(prompt) + 2 * 5
        assert value(m, "loramux_fair_share_counter", tenant=tenant) == len(prompt) + 2 * 5
    bad = {"fair_share": {"tn_x": {"counter": "high", "service": -1}, "tn_y": None}}
    m.set_state_source(lambda: bad)  # malformed values are left out, never break the scrape
    assert value(m, "loramux_fair_share_counter", tenant="tn_x") is None
