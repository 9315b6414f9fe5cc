"""Tests for loramux.engine.sampling.sampler: per-row filters, penalties, seeding, distribution, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from loramux.engine.sampling.sampler import Sampler, SamplerOutput, SamplingRow, apply_penalties


@pytest.fixture
def sampler() -> Sampler:
    return Sampler()


def _repeat(logits_row: torch.Tensor, n: int) -> torch.Tensor:
    return logits_row.unsqueeze(0).expand(n, -1).contiguous()


def _counts(tokens: list[int], vocab: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens), minlength=vocab).to(torch.float64)


def _assert_matches(tokens: list[int], probs: torch.Tensor) -> None:
    """Empirical frequencies within 5 standard errors (+ a small floor) of `probs`."""
    n = len(tokens)
    freq = _counts(tokens, probs.numel()) / n
    p = probs.to(torch.float64)
    tol = 5 * torch.sqrt(p * (1 - p) / n) + 2e-3
    assert torch.all((freq - p).abs() <= tol), (freq, p)
    # Chi-square over cells with enough expected mass; 99.9% quantile for <= 20 dof is < 46.
    expected = p * n
    keep = expected >= 5
    chi2 = (((freq * n - expected) ** 2) / expected)[keep].sum().item()
    assert chi2 < 46, chi2


# --- greedy ---------------------------------------------------------------------------------------


def test_greedy_equals_argmax_fast_path(sampler: Sampler) -> None:
    torch.manual_seed(0)
    logits = torch.randn(16, 300)
    rows = [SamplingRow(temperature=t) for t in [0.0, -1.0, 1e-6] * 5 + [0.0]]
    out = sampler(logits, rows, [None] * 16)
    assert isinstance(out, SamplerOutput)
    assert out.token_ids == logits.argmax(-1).tolist()
    expected = torch.log_softmax(logits, -1).gather(1, logits.argmax(-1, keepdim=True)).squeeze(1)
    assert torch.allclose(torch.tensor(out.logprobs), expected, atol=1e-5)


def test_greedy_bfloat16_input(sampler: Sampler) -> None:
    torch.manual_seed(1)
    logits = torch.randn(4, 200).to(torch.bfloat16)
    out = sampler(logits, [SamplingRow()] * 4, [None] * 4)
    assert out.token_ids == logits.float().argmax(-1).tolist()
    lp = torch.log_softmax(logits.float(), -1)
    assert out.logprobs == pytest.approx(
        [lp[i, t].item() for i, t in enumerate(out.token_ids)], abs=1e-5
    )


def test_empty_batch(sampler: Sampler) -> None:
    out = sampler(torch.empty(0, 10), [], [])
    assert out.token_ids == [] and out.logprobs == []


def test_top_k_1_equals_greedy(sampler: Sampler) -> None:
    torch.manual_seed(2)
    logits = torch.randn(32, 500)
    greedy = logits.argmax(-1).tolist()
    for seed in range(20):
        torch.manual_seed(seed)
        rows = [SamplingRow(temperature=1.0, top_k=1)] * 32
        gens = [Sampler.make_generator(seed) if i % 2 else None for i in range(32)]
        assert sampler(logits, rows, gens).token_ids == greedy


# --- truncation -----------------------------------------------------------------------------------


def test_top_p_drops_tail(sampler: Sampler) -> None:
    torch.manual_seed(3)
    logits = _repeat(torch.tensor([0.5, 0.3, 0.15, 0.05]).log(), 4000)
    out = sampler(logits, [SamplingRow(temperature=1.0, top_p=0.8)] * 4000, [None] * 4000)
    assert set(out.token_ids) == {0, 1}
    # Inside the nucleus the renormalised distribution is kept: 0.5/0.8 and 0.3/0.8.
    _assert_matches(out.token_ids, torch.tensor([0.625, 0.375, 0.0, 0.0]))

    out = sampler(logits, [SamplingRow(temperature=1.0, top_p=1.0)] * 4000, [None] * 4000)
    assert set(out.token_ids) == {0, 1, 2, 3}


def test_min_p_drops_low_tokens(sampler: Sampler) -> None:
    torch.manual_seed(4)
    probs = torch.tensor([0.4, 0.3, 0.2, 0.06, 0.04])
    logits = _repeat(probs.log(), 4000)
    # threshold 0.2 * 0.4 = 0.08: tokens 3 and 4 go.
    out = sampler(logits, [SamplingRow(temperature=1.0, min_p=0.2)] * 4000, [None] * 4000)
    assert set(out.token_ids) == {0, 1, 2}
    _assert_matches(out.token_ids, torch.tensor([4 / 9, 3 / 9, 2 / 9, 0.0, 0.0]))


def test_top_k_2_only_two_highest(sampler: Sampler) -> None:
    torch.manual_seed(5)
    logits = torch.randn(100).clamp(max=2.0)
    logits[17], logits[42] = 3.0, 2.6
    out = sampler(
        _repeat(logits, 2000), [SamplingRow(temperature=1.0, top_k=2)] * 2000, [None] * 2000
    )
    assert set(out.token_ids) == {17, 42}


def test_filters_never_remove_every_token(sampler: Sampler) -> None:
    torch.manual_seed(6)
    logits = torch.randn(5, 64)
    rows = [
        SamplingRow(temperature=1.0, top_p=0.0),
        SamplingRow(temperature=1.0, min_p=1.0),
        SamplingRow(temperature=1.0, min_p=5.0),
        SamplingRow(temperature=1.0, top_k=1, top_p=0.0, min_p=2.0),
        SamplingRow(temperature=0.7, top_k=10_000, top_p=1e-9),
    ]
    for _ in range(10):
        assert sampler(logits, rows, [None] * 5).token_ids == logits.argmax(-1).tolist()


# --- seeding --------------------------------------------------------------------------------------


def _run_request(
    sampler: Sampler,
    step_logits: list[torch.Tensor],
    row: SamplingRow,
    position: int,
    others: list[SamplingRow],
    other_seeds: list[int | None],
) -> list[int]:
    """Drive one seeded request through len(step_logits) engine steps, placed at `position`."""
    gen = Sampler.make_generator(row.seed)
    other_gens = [Sampler.make_generator(s) if s is not None else None for s in other_seeds]
    produced: list[int] = []
    for logits in step_logits:
        me = SamplingRow(**{**row.__dict__, "output_token_ids": tuple(produced)})
        rows = others[:position] + [me] + others[position:]
        gens = other_gens[:position] + [gen] + other_gens[position:]
        batch = (
            torch.randn(len(rows), logits.numel()) * 2
        )  # the neighbours' logits change each step
        batch[position] = logits
        produced.append(sampler(batch, rows, gens).token_ids[position])
    return produced


def test_seeded_rows_repeat_regardless_of_batch(sampler: Sampler) -> None:
    torch.manual_seed(7)
    steps = [torch.randn(50) * 0.3 for _ in range(8)]  # flat-ish: many tokens are plausible
    row = SamplingRow(
        temperature=0.9, top_p=0.95, frequency_penalty=0.2, seed=1234, prompt_token_ids=(1, 2, 3)
    )
    alone = _run_request(sampler, steps, row, 0, [], [])
    assert alone == _run_request(sampler, steps, row, 0, [], [])

    others = [
        SamplingRow(),
        SamplingRow(temperature=1.3, top_k=5, seed=99),
        SamplingRow(temperature=0.7, top_p=0.5, min_p=0.1),
        SamplingRow(
            temperature=1.0,
            repetition_penalty=1.5,
            presence_penalty=0.5,
            output_token_ids=(4, 4, 9),
            prompt_token_ids=(7,),
        ),
    ]
    for position in (0, 2, 4):
        torch.manual_seed(100 + position)  # different default-generator state for the unseeded rows
        assert _run_request(sampler, steps, row, position, others, [None, 99, None, None]) == alone

    other_seed = SamplingRow(**{**row.__dict__, "seed": 4321})
    assert _run_request(sampler, steps, other_seed, 0, [], []) != alone


# --- penalties ------------------------------------------------------------------------------------


def _penalty_logits() -> torch.Tensor:
    torch.manual_seed(8)
    logits = torch.randn(2, 30)
    # Columns 1, 3, 7 positive and 2, 5 negative so both repetition branches are exercised.
    logits[:, [1, 3, 7]] = torch.tensor([1.5, 0.75, 2.25])
    logits[:, [2, 5]] = torch.tensor([-1.25, -0.5])
    return logits


PROMPT, OUTPUT = (1, 2, 3), (3, 5, 5, 7)
PLAIN = SamplingRow()


def _check_only(
    changed: torch.Tensor, before: torch.Tensor, cols: list[int], expected: torch.Tensor
) -> None:
    others = [c for c in range(before.numel()) if c not in cols]
    assert torch.equal(changed[others], before[others])  # bit-identical
    assert torch.allclose(changed[cols], expected, rtol=0, atol=1e-6)
    assert not torch.any(changed[cols] == before[cols])


def test_repetition_penalty_prompt_and_output(sampler: Sampler) -> None:
    logits = _penalty_logits()
    before = logits.clone()
    row = SamplingRow(repetition_penalty=1.3, prompt_token_ids=PROMPT, output_token_ids=OUTPUT)
    out = apply_penalties(logits, [PLAIN, row])
    assert torch.equal(logits, before)  # input untouched
    assert torch.equal(out[0], logits[0])  # a row without penalties is untouched
    cols = [1, 2, 3, 5, 7]
    x = logits[1, cols]
    _check_only(out[1], logits[1], cols, torch.where(x > 0, x / 1.3, x * 1.3))


def test_presence_penalty_output_only() -> None:
    logits = _penalty_logits()
    out = apply_penalties(
        logits,
        [
            SamplingRow(presence_penalty=0.7, prompt_token_ids=PROMPT, output_token_ids=OUTPUT),
            PLAIN,
        ],
    )
    assert torch.equal(out[1], logits[1])
    cols = [3, 5, 7]  # prompt-only tokens 1, 2 are not penalised
    _check_only(out[0], logits[0], cols, logits[0, cols] - 0.7)


def test_frequency_penalty_scales_with_count() -> None:
    logits = _penalty_logits()
    out = apply_penalties(
        logits,
        [
            PLAIN,
            SamplingRow(frequency_penalty=0.4, prompt_token_ids=PROMPT, output_token_ids=OUTPUT),
        ],
    )
    assert torch.equal(out[0], logits[0])
    cols = [3, 5, 7]
    _check_only(out[1], logits[1], cols, logits[1, cols] - 0.4 * torch.tensor([1.0, 2.0, 1.0]))


def test_penalties_compose_and_accept_bfloat16() -> None:
    logits = _penalty_logits().to(torch.bfloat16)
    row = SamplingRow(
        repetition_penalty=2.0,
        frequency_penalty=0.25,
        presence_penalty=0.5,
        prompt_token_ids=PROMPT,
        output_token_ids=OUTPUT,
    )
    out = apply_penalties(logits, [row, row])
    assert out.dtype == torch.float32
    for i in range(2):
        x = logits.float()[i]
        rep = torch.where(x > 0, x / 2.0, x * 2.0)
        expected = x.clone()
        expected[[1, 2]] = rep[[1, 2]]
        expected[[3, 5, 7]] = rep[[3, 5, 7]] - 0.25 * torch.tensor([1.0, 2.0, 1.0]) - 0.5
        assert torch.allclose(out[i], expected, atol=1e-6)


def test_penalties_steer_greedy(sampler: Sampler) -> None:
    logits = torch.tensor([[5.0, 4.9, 0.0, -1.0]])
    assert sampler(
        logits, [SamplingRow(presence_penalty=0.5, output_token_ids=(0,))], [None]
    ).token_ids == [1]
    assert sampler(
        logits, [SamplingRow(repetition_penalty=1.1, prompt_token_ids=(0,))], [None]
    ).token_ids == [1]


# --- distribution ---------------------------------------------------------------------------------


def test_sampled_distribution_matches_softmax(sampler: Sampler) -> None:
    torch.manual_seed(9)
    logits = torch.randn(10)
    n = 20_000
    out = sampler(_repeat(logits, n), [SamplingRow(temperature=1.0)] * n, [None] * n)
    _assert_matches(out.token_ids, torch.softmax(logits, -1))


def test_temperature_sharpens(sampler: Sampler) -> None:
    torch.manual_seed(10)
    logits = torch.randn(10)
    n = 20_000
    out = sampler(_repeat(logits, n), [SamplingRow(temperature=0.5)] * n, [None] * n)
    sharp = torch.softmax(logits / 0.5, -1)
    _assert_matches(out.token_ids, sharp)
    top = int(logits.argmax())
    assert sharp[top] > torch.softmax(logits, -1)[top]


def test_seeded_draws_match_distribution(sampler: Sampler) -> None:
    torch.manual_seed(11)
    logits = torch.randn(8)
    n = 4000
    gens = [Sampler.make_generator(s) for s in range(n)]
    out = sampler(_repeat(logits, n), [SamplingRow(temperature=1.0)] * n, gens)
    _assert_matches(out.token_ids, torch.softmax(logits, -1))


# --- logprobs and mixed batches -------------------------------------------------------------------


def test_logprobs_use_raw_logits(sampler: Sampler) -> None:
    torch.manual_seed(12)
    logits = torch.randn(4, 80)
    rows = [
        SamplingRow(temperature=0.3, top_k=5),
        SamplingRow(temperature=2.0, top_p=0.5, repetition_penalty=1.5, prompt_token_ids=(1, 2)),
        SamplingRow(presence_penalty=3.0, output_token_ids=tuple(range(40))),
        SamplingRow(temperature=1.0, min_p=0.3, frequency_penalty=1.0, output_token_ids=(5, 5)),
    ]
    out = sampler(logits, rows, [None, Sampler.make_generator(1), None, None])
    lp = torch.log_softmax(logits, -1)
    expected = [lp[i, t].item() for i, t in enumerate(out.token_ids)]
    assert out.logprobs == pytest.approx(expected, abs=1e-5)


def test_mixed_batch_rows_behave_as_alone(sampler: Sampler) -> None:
    torch.manual_seed(13)
    vocab = 200
    rows = [
        SamplingRow(),
        SamplingRow(repetition_penalty=1.4, prompt_token_ids=(3, 4), output_token_ids=(9,)),
        SamplingRow(temperature=1.0, top_k=3),
        SamplingRow(temperature=0.8, top_p=0.6),
        SamplingRow(temperature=0.8, min_p=0.05, seed=7),
        SamplingRow(
            temperature=1.2,
            top_k=20,
            top_p=0.9,
            frequency_penalty=0.3,
            presence_penalty=0.2,
            output_token_ids=(1, 1, 2),
            seed=8,
        ),
        SamplingRow(temperature=1.0),
    ]
    seeded = {4, 5}
    batch_gens = [
        Sampler.make_generator(r.seed) if i in seeded else None for i, r in enumerate(rows)
    ]
    alone_gens = [
        Sampler.make_generator(r.seed) if i in seeded else None for i, r in enumerate(rows)
    ]
    for _ in range(5):
        logits = torch.randn(len(rows), vocab) * 1.5
        batch = sampler(logits, rows, batch_gens)
        lp = torch.log_softmax(logits, -1)
        for i, row in enumerate(rows):
            tok = batch.token_ids[i]
            assert batch.logprobs[i] == pytest.approx(lp[i, tok].item(), abs=1e-5)
            alone = sampler(logits[i : i + 1], [row], [alone_gens[i]])
            if i in seeded or i < 2:
                assert tok == alone.token_ids[0], i
        # Unseeded truncated rows stay inside their own allowed sets.
        assert batch.token_ids[2] in logits[2].topk(3).indices.tolist()
        probs = torch.softmax(logits[3] / 0.8, -1)
        sorted_p, order = probs.sort(descending=True)
        nucleus = order[: int((sorted_p.cumsum(0) < 0.6).sum()) + 1].tolist()
        assert batch.token_ids[3] in nucleus


def test_make_generator_is_seeded_cpu_generator() -> None:
    a, b = Sampler.make_generator(5), Sampler.make_generator(5)
    assert a.device.type == "cpu"
    assert torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))
    assert not math.isclose(
        torch.rand(1, generator=Sampler.make_generator(6)).item(),
        torch.rand(1, generator=Sampler.make_generator(5)).item(),
    )


# --- logit_bias, token masks, top_logprobs -----------------------------------------------------------


def _bool_masker(allowed: torch.Tensor, rows: list[int]):
    """A token masker (as structured output passes one) from a bool [B, V] allowed-matrix, on `rows`."""

    def mask(x: torch.Tensor) -> None:
        for i in rows:
            x[i].masked_fill_(~allowed[i], float("-inf"))

    return mask


def test_logit_bias_steers_greedy_and_sampling(sampler: Sampler) -> None:
    torch.manual_seed(20)
    logits = torch.randn(3, 300)
    top = logits.argmax(-1).tolist()
    rows = [SamplingRow(logit_bias={7: 100.0}), SamplingRow(logit_bias={top[1]: -100.0}),
            SamplingRow(temperature=1.0, logit_bias={11: 100.0})]
    out = sampler(logits, rows, [None, None, Sampler.make_generator(0)])
    assert out.token_ids[0] == 7 and out.token_ids[2] == 11
    assert out.token_ids[1] == logits[1].topk(2).indices[1].item()  # the argmax banned: the runner-up
    # The reported logprobs are the raw model's, not the biased distribution's.
    lp = torch.log_softmax(logits, -1)
    assert out.logprobs == pytest.approx([lp[i, t].item() for i, t in enumerate(out.token_ids)], abs=1e-5)
    # Several biases on one row: each on its own token.
    both = sampler(logits[:1], [SamplingRow(logit_bias={3: 50.0, 4: 60.0})], [None])
    assert both.token_ids == [4]


def test_bias_and_mask_leave_other_rows_bit_identical(sampler: Sampler) -> None:
    torch.manual_seed(21)
    vocab = 400
    logits = torch.randn(4, vocab)
    plain_rows = [SamplingRow(temperature=0.9, top_p=0.9, seed=1), SamplingRow(repetition_penalty=1.3,
                                                                                 output_token_ids=[1, 2])]
    special_rows = [SamplingRow(temperature=0.7, seed=2, logit_bias={5: 3.0}), SamplingRow(temperature=0.0)]
    allowed = torch.zeros(4, vocab, dtype=torch.bool)
    allowed[3, 100:120] = True
    gens = [Sampler.make_generator(1), None, Sampler.make_generator(2), None]
    mixed = sampler(logits, plain_rows + special_rows, gens, _bool_masker(allowed, [3]))
    alone = sampler(logits[:2], plain_rows, [Sampler.make_generator(1), None])
    assert mixed.token_ids[:2] == alone.token_ids and mixed.logprobs[:2] == alone.logprobs
    assert 100 <= mixed.token_ids[3] < 120 and mixed.token_ids[3] == 100 + logits[3, 100:120].argmax().item()
    probs, raw = sampler.probs(logits, plain_rows + special_rows, _bool_masker(allowed, [3]))
    ref_probs, ref_raw = sampler.probs(logits[:2], plain_rows)
    assert torch.equal(probs[:2], ref_probs) and torch.equal(raw, torch.log_softmax(logits, -1))
    assert probs[3].sum() == 1.0 and probs[3, 100 + logits[3, 100:120].argmax()] == 1.0


def test_masked_sampling_stays_in_the_allowed_set(sampler: Sampler) -> None:
    torch.manual_seed(22)
    vocab = 64
    logits = torch.randn(1, vocab)
    allowed = torch.zeros(1, vocab, dtype=torch.bool)
    allowed[0, [3, 9, 40]] = True
    gen = Sampler.make_generator(5)
    draws = [sampler(logits, [SamplingRow(temperature=1.0)], [gen], _bool_masker(allowed, [0])).token_ids[0]
             for _ in range(3000)]
    assert set(draws) == {3, 9, 40}
    expected = torch.zeros(vocab)
    expected[[3, 9, 40]] = torch.softmax(logits[0, [3, 9, 40]], -1)
    _assert_matches(draws, expected)


def test_top_logprobs_per_row(sampler: Sampler) -> None:
    torch.manual_seed(23)
    logits = (torch.randn(5, 500) * 3).to(torch.bfloat16)
    ks = [0, 1, 5, 20, 0]
    rows = [SamplingRow(top_logprobs=k, temperature=0.5 * (i % 2), logit_bias={0: 40.0} if i == 2 else {})
            for i, k in enumerate(ks)]
    out = sampler(logits, rows, [None] * 5)
    lp = torch.log_softmax(logits.float(), -1)
    for i, k in enumerate(ks):
        assert len(out.top_logprobs[i]) == k
        if k:
            values, ids = lp[i].topk(k)
            assert [t for t, _ in out.top_logprobs[i]] == ids.tolist()
            assert [v for _, v in out.top_logprobs[i]] == pytest.approx(values.tolist(), abs=1e-5)
    # Without top_logprobs anywhere the output is as before: no lists to fill.
    assert sampler(logits, [SamplingRow()] * 5, [None] * 5).top_logprobs == [[]] * 5
