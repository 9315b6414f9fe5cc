"""The speculation policy (torch-free): per-row method choice from measured acceptance, and speculating only
while the step cost model says the step's throughput gains."""
from __future__ import annotations

import pytest

from loramux.engine.scheduling.step_budget import StepWork
from loramux.engine.speculation.policy import AcceptanceStats, Candidate, SpecPolicy, expected_tokens
from loramux.engine.speculation.speculator import parse_methods


def cpu_like(work: StepWork) -> float:
    """A weight-bound small-batch step: a fixed pass over the weights, then compute that grows with tokens and
    a separate attention call per verification chunk."""
    return 0.038 + 0.0004 * work.seqs + 0.0015 * work.chunks + 0.0016 * work.tokens + 0.0002 * work.attended


def rows(n: int, drafts: dict[str, int], adapter: str = "") -> list[Candidate]:
    return [Candidate(i, adapter, 200, dict(drafts)) for i in range(n)]


def test_expected_tokens_is_the_geometric_sum():
    assert expected_tokens(0.5, 3) == pytest.approx(0.875)
    assert expected_tokens(1.0, 4) == 4 and expected_tokens(0.0, 4) == 0


def test_speculates_at_small_batch_and_stops_under_load():
    policy = SpecPolicy(cpu_like)
    assert len(policy.choose(rows(1, {"medusa": 3}))) == 1
    assert len(policy.choose(rows(2, {"medusa": 3}))) == 2
    assert policy.choose(rows(48, {"medusa": 3})) == {}  # verification work now costs more than it gains
    # Acceptance decides too: a method that keeps missing is dropped even at batch 1.
    for _ in range(200):
        policy.stats.record("", "medusa", 3, 0)
    assert policy.choose(rows(1, {"medusa": 3})) == {}


def test_each_row_gets_the_method_with_most_expected_tokens_per_adapter():
    stats = AcceptanceStats()
    for _ in range(100):
        stats.record("legal", "ngram", 4, 4)  # prompt lookup copies this adapter's answers well
        stats.record("legal", "medusa", 3, 0)
        stats.record("chat", "ngram", 4, 0)
        stats.record("chat", "medusa", 3, 3)
    policy = SpecPolicy(None, stats)
    chosen = policy.choose([Candidate("a", "legal", 10, {"ngram": 4, "medusa": 3}),
                            Candidate("b", "chat", 10, {"ngram": 4, "medusa": 3})])
    assert chosen == {"a": ("ngram", 4), "b": ("medusa", 3)}
    snap = stats.snapshot()
    assert snap["ngram"] == {"proposed": 800, "accepted": 400, "verifications": 200}


def test_draft_model_cost_counts():
    policy = SpecPolicy(cpu_like)
    assert policy.choose(rows(1, {"draft": 4})) != {}
    policy.observe_draft_cost(4, 4 * 0.05)  # a draft model as slow as the target per token never pays
    assert policy.choose(rows(1, {"draft": 4})) == {}


def test_no_cost_model_speculates_whenever_a_draft_exists():
    assert len(SpecPolicy(None).choose(rows(64, {"ngram": 2}))) == 64
    assert SpecPolicy(None).choose(rows(3, {"ngram": 0})) == {}


def test_methods_setting_is_checked():
    assert parse_methods(" medusa, ngram ") == ("medusa", "ngram")
    with pytest.raises(ValueError, match="unknown speculative method 'eagle'"):
        parse_methods("ngram,eagle")


def test_draft_length_follows_acceptance():
    stats = AcceptanceStats()
    for _ in range(100):
        stats.record("sure", "medusa", 4, 4)
        stats.record("unsure", "medusa", 4, 1)  # p = 1/2: later drafts rarely survive
    policy = SpecPolicy(lambda w: 0.038 + 0.004 * w.tokens, stats)
    assert policy.choose([Candidate("a", "sure", 10, {"medusa": 4})]) == {"a": ("medusa", 4)}
    method, length = policy.choose([Candidate("b", "unsure", 10, {"medusa": 4})])["b"]
    assert method == "medusa" and 1 <= length < 4
