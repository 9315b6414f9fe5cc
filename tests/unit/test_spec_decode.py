"""Tests for loramux.engine.speculation.verification (prompt-lookup drafts, verification) and Sampler.probs."""

from __future__ import annotations

import random
import time

import pytest
import torch

from loramux.engine.sampling.sampler import Sampler, SamplingRow, apply_penalties
from loramux.engine.speculation.verification import (
    Verdict,
    build_verdict,
    propose_ngram,
    verify,
    verify_greedy,
)

# --- helpers --------------------------------------------------------------------------------------


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit of `counts` to `probs` (any shape, flattened).

    Zero-probability cells must be empty and take no degree of freedom.
    """
    counts = counts.flatten().to(torch.float64)
    probs = probs.flatten().to(torch.float64)
    zero = probs == 0
    assert counts[zero].sum().item() == 0, "a zero-probability outcome occurred"
    n = counts.sum()
    expected = probs[~zero] / probs.sum() * n
    stat = ((counts[~zero] - expected) ** 2 / expected).sum()
    dof = torch.tensor(float((~zero).sum().item() - 1), dtype=torch.float64)
    return torch.special.gammaincc(dof / 2, stat / 2).item()


ALPHA = 1e-3


def test_chi2_helper_matches_tabulated_critical_values() -> None:
    # 0.999 quantiles of chi-square: 5 dof -> 20.515, 35 dof -> 66.619.
    for dof, crit in ((5, 20.515), (35, 66.619)):
        p = torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(crit / 2)).item()
        assert p == pytest.approx(ALPHA, rel=1e-3)
    assert _chi2_pvalue(torch.tensor([500.0, 500.0, 0.0]), torch.tensor([0.5, 0.5, 0.0])) == 1.0
    assert _chi2_pvalue(torch.tensor([600.0, 400.0]), torch.tensor([0.5, 0.5])) < ALPHA


# --- propose_ngram --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tokens", "num_draft", "kwargs", "expected"),
    [
        # n = 3: [1, 2, 3] occurred at 0.
        ([1, 2, 3, 4, 5, 9, 1, 2, 3], 3, {}, [4, 5, 9]),
        # n = 2: [2, 3] occurred at 1 (no earlier [1, 2, 3]).
        ([7, 2, 3, 4, 8, 1, 2, 3], 3, {}, [4, 8, 1]),
        # n = 1: only the last token recurs.
        ([5, 1, 6, 7, 8, 1], 3, {}, [6, 7, 8]),
        # The longest n-gram wins over a more recent shorter one.
        ([1, 2, 3, 10, 11, 9, 3, 20, 21, 1, 2, 3], 2, {}, [10, 11]),
        # Among occurrences of the same n-gram, the most recent wins.
        ([1, 2, 5, 1, 2, 6, 1, 2], 2, {}, [6, 1]),
        # Fewer than num_draft near the end (followers may run into the suffix).
        ([4, 5, 4], 5, {}, [5, 4]),
        ([1, 1, 1, 1], 5, {}, [1]),
        # No match, empty or one-token context, nothing asked for.
        ([1, 2, 3, 4], 3, {}, []),
        ([], 3, {}, []),
        ([7], 3, {}, []),
        ([1, 2, 1], 0, {}, []),
        # Window: the [1, 2] occurrence at 0 falls outside the last 7 tokens.
        ([1, 2, 9, 5, 2, 8, 1, 2], 2, {"window": 8}, [9, 5]),
        ([1, 2, 9, 5, 2, 8, 1, 2], 2, {"window": 7}, [8, 1]),
        ([1, 7, 8, 2, 3, 4, 5, 1], 2, {"window": 7}, []),
        # min_ngram / max_ngram bounds.
        ([1, 2, 3, 5, 2], 2, {"min_ngram": 2}, []),
        ([1, 2, 3, 5, 2], 2, {"min_ngram": 1}, [3, 5]),
        ([1, 2, 3, 4, 9, 2, 3, 4, 7, 1, 2, 3, 4], 2, {"max_ngram": 4}, [9, 2]),
        ([1, 2, 3, 4, 9, 2, 3, 4, 7, 1, 2, 3, 4], 2, {"max_ngram": 3}, [7, 1]),
        # A byte-level match straddling tokens (256, 0 contains the bytes of 1) is not a match.
        ([256, 0, 5, 1], 2, {}, []),
        ([1, 7, 256, 0, 5, 1], 2, {}, [7, 256]),
        # Any Sequence; large ids.
        ((100_000, 3, 150_000, 100_000), 2, {}, [3, 150_000]),
    ],
)
def test_propose_ngram_table(tokens, num_draft, kwargs, expected) -> None:
    assert propose_ngram(tokens, num_draft, **kwargs) == expected


def test_propose_ngram_rejects_min_ngram_zero() -> None:
    with pytest.raises(ValueError):
        propose_ngram([1, 2, 1], 2, min_ngram=0)


def test_propose_ngram_matches_brute_force() -> None:
    """Random small-vocabulary contexts against a direct transcription of the definition."""

    def brute(toks, num_draft, max_ngram, min_ngram, window):
        n_tok = len(toks)
        lo = max(0, n_tok - window)
        for n in range(max_ngram, min_ngram - 1, -1):
            if n >= n_tok:
                continue
            suffix = toks[n_tok - n :]
            for s in range(n_tok - n - 1, lo - 1, -1):
                if toks[s : s + n] == suffix:
                    return toks[s + n : s + n + num_draft]
        return []

    rng = random.Random(0)
    for _ in range(500):
        toks = [rng.randrange(4) for _ in range(rng.randrange(0, 40))]
        args = (rng.randrange(1, 6), rng.randrange(1, 5), 1, rng.randrange(1, 45))
        assert propose_ngram(toks, *args) == brute(toks, *args), (toks, args)


def _median_seconds(fn, repeats: int = 31) -> float:
    """The median CPU time of `fn` on this thread (what other load on the machine does not change)."""
    times = []
    for _ in range(repeats):
        start = time.thread_time()
        fn()
        times.append(time.thread_time() - start)
    return sorted(times)[repeats // 2]


def test_propose_ngram_speed_4k_tokens() -> None:
    rng = random.Random(1)
    typical = [rng.randrange(32_000) for _ in range(4096)]  # no repeated 1-gram: full scans
    repeated = typical[:3000] + typical[500:1096]  # a long repeat: matched at n = 4
    degenerate = [0] * 4095 + [1]  # many near-matches
    assert propose_ngram(repeated, 5) == typical[1096:1101]
    for toks in (typical, repeated, degenerate):
        assert _median_seconds(lambda t=toks: propose_ngram(t, 5)) < 1e-3


# --- verify: greedy -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("target", "draft", "accepted"),
    [
        ([5, 6, 7, 8], [5, 6, 7], 3),  # all accepted
        ([5, 6, 7, 8], [5, 9, 7], 1),  # first mismatch at 1 (a later match does not count)
        ([5, 6, 7, 8], [4, 6, 7], 0),  # none
        ([5], [], 0),  # no draft
    ],
)
def test_verify_greedy_table(target, draft, accepted) -> None:
    assert verify_greedy(target, draft) == accepted
    # The same through verify: one-hot rows at the target argmax; next = argmax at the stop.
    probs = torch.nn.functional.one_hot(torch.tensor(target), 10).float()
    assert verify(probs, draft, None, greedy=True) == (accepted, target[accepted])


def test_verify_greedy_uses_argmax_of_soft_rows() -> None:
    torch.manual_seed(0)
    probs = torch.softmax(torch.randn(4, 20) * 3, -1)
    top = probs.argmax(-1).tolist()
    gen = Sampler.make_generator(0)
    state = gen.get_state()
    assert verify(probs, top[:3], gen, greedy=True) == (3, top[3])
    wrong = (top[1] + 1) % 20
    assert verify(probs, [top[0], wrong, top[2]], gen, greedy=True) == (1, top[1])
    assert torch.equal(gen.get_state(), state)  # greedy draws nothing


def test_verify_validates_inputs() -> None:
    probs = torch.full((3, 6), 1 / 6)
    with pytest.raises(ValueError):
        verify(probs, [1], None, greedy=False)  # needs 2 rows
    with pytest.raises(ValueError):
        verify(probs, [1, 6], None, greedy=False)  # token 6 outside V = 6
    with pytest.raises(ValueError):
        verify(probs[0], [], None, greedy=True)  # 1-D


# --- verify: sampling -----------------------------------------------------------------------------

V = 6
P0 = torch.tensor([0.35, 0.25, 0.2, 0.12, 0.08, 0.0])
# Conditional target at the second position given the first token (row t0), with zeros.
P1 = torch.tensor(
    [
        [0.5, 0.2, 0.1, 0.1, 0.1, 0.0],
        [0.1, 0.1, 0.6, 0.0, 0.1, 0.1],
        [0.2, 0.2, 0.2, 0.2, 0.1, 0.1],
        [0.0, 0.3, 0.0, 0.3, 0.2, 0.2],
        [0.15, 0.15, 0.15, 0.15, 0.2, 0.2],
        [0.3, 0.3, 0.1, 0.1, 0.1, 0.1],
    ]
)
UNIFORM = torch.full((V,), 1 / V)


@pytest.mark.parametrize(
    "draft",
    [[0], [4], [5], [1, 2]],
    ids=["likely", "unlikely", "impossible", "two-tokens"],
)
def test_first_token_distribution_is_target(draft: list[int]) -> None:
    """Whatever the draft, the first emitted token is distributed as P0; draft[0] is accepted
    with probability P0[draft[0]]."""
    n = 8000
    probs = torch.stack([P0] + [UNIFORM] * len(draft))
    gen = Sampler.make_generator(123)
    counts = torch.zeros(V)
    accepted_first = 0
    for _ in range(n):
        accepted, nxt = verify(probs, draft, gen, greedy=False)
        first = draft[0] if accepted else nxt
        counts[first] += 1
        accepted_first += accepted > 0
        if not accepted:
            assert nxt != draft[0]  # a rejection never re-emits the draft
    assert _chi2_pvalue(counts, P0) > ALPHA, counts
    p = P0[draft[0]].item()
    assert abs(accepted_first / n - p) <= 5 * (p * (1 - p) / n) ** 0.5 + 1e-9


@pytest.mark.parametrize("draft", [[0, 0], [3, 5], [5, 2]], ids=["likely", "mixed", "impossible"])
def test_two_token_joint_distribution_is_target(draft: list[int]) -> None:
    """End to end over two positions with a context-dependent target: the second position's
    distribution is P1[first token]; after a rejection at position 0 the next step verifies
    draft[1] against P1[actual first token]. The first two tokens must follow P0 (x) P1."""
    n = 10_000
    d0, d1 = draft
    gen = Sampler.make_generator(7)
    counts = torch.zeros(V, V)
    for _ in range(n):
        accepted, nxt = verify(torch.stack([P0, P1[d0], UNIFORM]), draft, gen, greedy=False)
        tokens = draft[:accepted] + [nxt]
        if len(tokens) == 1:  # rejected at 0: the next engine step, conditioned on tokens[0]
            acc2, nxt2 = verify(torch.stack([P1[tokens[0]], UNIFORM]), [d1], gen, greedy=False)
            tokens += [d1] if acc2 else [nxt2]
        counts[tokens[0], tokens[1]] += 1
    joint = P0.unsqueeze(1) * P1
    assert _chi2_pvalue(counts, joint) > ALPHA, counts


def test_bonus_token_drawn_from_last_row_when_all_accepted() -> None:
    one_hot = torch.nn.functional.one_hot(torch.tensor([2, 4]), V).float()
    probs = torch.cat([one_hot, P0.unsqueeze(0)])
    gen = Sampler.make_generator(3)
    counts = torch.zeros(V)
    for _ in range(3000):
        accepted, nxt = verify(probs, [2, 4], gen, greedy=False)
        assert accepted == 2  # a draft holding all of its row's mass is always accepted
        counts[nxt] += 1
    assert _chi2_pvalue(counts, P0) > ALPHA


def test_zero_probability_draft_is_never_accepted() -> None:
    probs = torch.stack([P0, UNIFORM])
    gen = Sampler.make_generator(4)
    assert all(verify(probs, [5], gen, greedy=False)[0] == 0 for _ in range(2000))


def test_unnormalised_rows_behave_as_normalised() -> None:
    probs = torch.stack([P0, P1[0], P1[3]])
    for seed in range(50):
        a = verify(probs, [1, 3], Sampler.make_generator(seed), greedy=False)
        b = verify(probs * 3.5, [1, 3], Sampler.make_generator(seed), greedy=False)
        assert a == b


def test_seeded_verify_is_reproducible() -> None:
    probs = torch.stack([P0, P1[2], P1[4]])

    def run(seed: int) -> list[tuple[int, int]]:
        gen = Sampler.make_generator(seed)
        return [verify(probs, [0, 2], gen, greedy=False) for _ in range(200)]

    torch.manual_seed(0)
    first = run(11)
    torch.manual_seed(99)  # the global RNG does not matter to a seeded request
    assert run(11) == first
    assert run(12) != first
    assert len(set(first)) > 3

    # Unseeded: the global RNG.
    torch.manual_seed(5)
    a = [verify(probs, [0, 2], None, greedy=False) for _ in range(50)]
    torch.manual_seed(5)
    assert [verify(probs, [0, 2], None, greedy=False) for _ in range(50)] == a


def test_build_verdict() -> None:
    raw = torch.log_softmax(torch.randn(4, 10), -1)
    v = build_verdict([3, 7, 1], 2, 9, raw)
    assert isinstance(v, Verdict)
    assert v.accepted == 2 and v.tokens == [3, 7, 9]
    assert v.logprobs == pytest.approx([raw[0, 3].item(), raw[1, 7].item(), raw[2, 9].item()])
    v = build_verdict([3, 7, 1], 0, 4, raw)
    assert v.tokens == [4] and v.logprobs == pytest.approx([raw[0, 4].item()])
    assert len(build_verdict([], 0, 2, raw[:1]).tokens) == 1


# --- Sampler.probs --------------------------------------------------------------------------------


@pytest.fixture
def sampler() -> Sampler:
    return Sampler()


def test_probs_greedy_rows_are_one_hot_at_penalised_argmax(sampler: Sampler) -> None:
    logits = torch.tensor([[5.0, 4.9, 0.0, -1.0], [0.1, 0.2, 3.0, 0.0], [5.0, 4.9, 0.0, -1.0]])
    rows = [
        SamplingRow(presence_penalty=0.5, output_token_ids=(0,)),  # steered to 1
        SamplingRow(temperature=-1.0),
        SamplingRow(),
    ]
    probs, raw_lp = sampler.probs(logits, rows)
    assert probs.dtype == torch.float32 and probs.shape == (3, 4)
    assert probs.tolist() == [[0, 1, 0, 0], [0, 0, 1, 0], [1, 0, 0, 0]]
    assert probs.argmax(-1).tolist() == sampler(logits, rows, [None] * 3).token_ids
    assert torch.allclose(raw_lp, torch.log_softmax(logits, -1))


def test_probs_closed_forms(sampler: Sampler) -> None:
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0]).clamp_min(1e-9).log()
    batch = logits.unsqueeze(0).expand(5, -1).contiguous()
    rows = [
        SamplingRow(temperature=1.0),
        SamplingRow(temperature=0.5),
        SamplingRow(temperature=1.0, top_p=0.8),
        SamplingRow(temperature=1.0, top_k=3),
        SamplingRow(temperature=1.0, min_p=0.25),  # threshold 0.125: keeps 0, 1, 2
    ]
    probs, _ = sampler.probs(batch, rows)
    p = torch.softmax(logits, -1)
    expected = torch.stack(
        [
            p,
            torch.softmax(logits / 0.5, -1),
            torch.tensor([0.625, 0.375, 0, 0, 0]),
            torch.tensor([0.5, 0.3, 0.15, 0, 0]) / 0.95,
            torch.tensor([0.5, 0.3, 0.15, 0, 0]) / 0.95,
        ]
    )
    assert torch.allclose(probs, expected, atol=1e-6)
    assert torch.allclose(probs.sum(-1), torch.ones(5))
    assert torch.equal(probs == 0, expected == 0)  # filtered tokens are exactly zero


def test_probs_match_call_sampling(sampler: Sampler) -> None:
    torch.manual_seed(20)
    logits = torch.randn(12) * 1.5
    rows = [
        SamplingRow(temperature=0.8),
        SamplingRow(temperature=1.2, top_k=5),
        SamplingRow(temperature=0.9, top_p=0.85),
        SamplingRow(temperature=1.0, min_p=0.08),
        SamplingRow(
            temperature=1.1,
            top_k=8,
            top_p=0.95,
            repetition_penalty=1.3,
            frequency_penalty=0.4,
            presence_penalty=0.3,
            prompt_token_ids=(1, 2),
            output_token_ids=tuple(logits.topk(3).indices.tolist()) * 2,
        ),
    ]
    probs, _ = sampler.probs(logits.unsqueeze(0).expand(len(rows), -1), rows)
    n = 12_000
    for i, row in enumerate(rows):
        out = sampler(logits.unsqueeze(0).expand(n, -1), [row] * n, [None] * n)
        counts = torch.bincount(torch.tensor(out.token_ids), minlength=12)
        assert _chi2_pvalue(counts, probs[i]) > ALPHA, (i, counts, probs[i])
    # Seeded rows draw from the same distribution.
    gens = [Sampler.make_generator(s) for s in range(3000)]
    out = sampler(logits.unsqueeze(0).expand(3000, -1), [rows[4]] * 3000, gens)
    assert _chi2_pvalue(torch.bincount(torch.tensor(out.token_ids), minlength=12), probs[4]) > ALPHA


def test_probs_penalties_as_in_call(sampler: Sampler) -> None:
    torch.manual_seed(21)
    logits = torch.randn(2, 30)
    row = SamplingRow(
        temperature=0.7,
        repetition_penalty=1.5,
        frequency_penalty=0.5,
        presence_penalty=0.2,
        prompt_token_ids=(1, 2, 3),
        output_token_ids=(3, 5, 5, 7),
    )
    rows = [row, SamplingRow(temperature=0.7)]
    probs, raw_lp = sampler.probs(logits, rows)
    expected = torch.softmax(apply_penalties(logits, rows) / 0.7, -1)
    assert torch.allclose(probs, expected, atol=1e-6)
    assert not torch.allclose(probs[0], torch.softmax(logits[0] / 0.7, -1), atol=1e-3)
    assert torch.allclose(probs[1], torch.softmax(logits[1] / 0.7, -1), atol=1e-6)
    assert torch.allclose(raw_lp, torch.log_softmax(logits, -1))  # raw, not penalised


def test_probs_rows_independent_of_batch_and_dtype(sampler: Sampler) -> None:
    torch.manual_seed(22)
    logits = (torch.randn(5, 64) * 2).to(torch.bfloat16)
    rows = [
        SamplingRow(),
        SamplingRow(temperature=0.6, top_k=10, min_p=0.05),
        SamplingRow(temperature=1.3, top_p=0.7, frequency_penalty=0.3, output_token_ids=(4, 4)),
        SamplingRow(repetition_penalty=1.2, prompt_token_ids=(0, 1, 2)),
        SamplingRow(temperature=1.0),
    ]
    probs, raw_lp = sampler.probs(logits, rows)
    assert probs.dtype == raw_lp.dtype == torch.float32
    assert torch.allclose(raw_lp, torch.log_softmax(logits.float(), -1))
    for i, row in enumerate(rows):
        alone, _ = sampler.probs(logits[i : i + 1], [row])
        assert torch.allclose(alone[0], probs[i], atol=1e-7), i


def test_probs_empty_batch(sampler: Sampler) -> None:
    probs, raw_lp = sampler.probs(torch.empty(0, 10), [])
    assert probs.shape == raw_lp.shape == (0, 10)


# --- end to end with a toy model ------------------------------------------------------------------

TOY_V = 40


def _toy_logits(context: list[int]) -> torch.Tensor:
    """A deterministic 'model': the logits depend on the last two tokens only (so it loops)."""
    gen = torch.Generator().manual_seed(1000 * context[-2] + context[-1])
    return torch.randn(TOY_V, generator=gen) * 3


def _plain_greedy(prompt: list[int], row: SamplingRow, steps: int, sampler: Sampler):
    out: list[int] = []
    lps: list[float] = []
    for _ in range(steps):
        r = SamplingRow(**{**row.__dict__, "output_token_ids": tuple(out)})
        res = sampler(_toy_logits(prompt + out).unsqueeze(0), [r], [None])
        out += res.token_ids
        lps += res.logprobs
    return out, lps


def _speculative_greedy(prompt: list[int], row: SamplingRow, steps: int, sampler: Sampler):
    out: list[int] = []
    lps: list[float] = []
    accepted_total = 0
    while len(out) < steps:
        draft = propose_ngram(prompt + out, min(4, steps - len(out) - 1))
        ctxs = [prompt + out + draft[:j] for j in range(len(draft) + 1)]
        rows = [
            SamplingRow(**{**row.__dict__, "output_token_ids": tuple(out + draft[:j])})
            for j in range(len(draft) + 1)
        ]
        probs, raw_lp = sampler.probs(torch.stack([_toy_logits(c) for c in ctxs]), rows)
        accepted, nxt = verify(probs, draft, None, greedy=True)
        verdict = build_verdict(draft, accepted, nxt, raw_lp)
        assert len(verdict.tokens) == verdict.accepted + 1
        out += verdict.tokens
        lps += verdict.logprobs
        accepted_total += accepted
    return out, lps, accepted_total


@pytest.mark.parametrize(
    "row",
    [SamplingRow(), SamplingRow(frequency_penalty=0.1, repetition_penalty=1.05)],
    ids=["plain", "penalised"],
)
def test_speculative_greedy_equals_plain_greedy(sampler: Sampler, row: SamplingRow) -> None:
    prompt = [3, 17, 5, 3, 17]
    row = SamplingRow(**{**row.__dict__, "prompt_token_ids": tuple(prompt)})
    plain, plain_lp = _plain_greedy(prompt, row, 40, sampler)
    spec, spec_lp, accepted = _speculative_greedy(prompt, row, 40, sampler)
    assert spec == plain
    assert spec_lp == pytest.approx(plain_lp, abs=1e-5)
    assert accepted > 0  # the drafts did something
    if row.frequency_penalty:  # and the penalties did too (they must see the drafts)
        unpenalised = SamplingRow(prompt_token_ids=tuple(prompt))
        assert _plain_greedy(prompt, unpenalised, 40, sampler)[0] != plain
