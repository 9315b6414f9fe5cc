"""Decode attention in groups of similar context length: the plan, and the same outputs as one padded batch."""
from __future__ import annotations

import itertools

import pytest

from conftest import make_engine
from loramux.engine import model_runner
from loramux.engine.sampling.params import SamplingParams
from loramux.engine.scheduling.decode_groups import plan_decode_groups


def cost(groups: list[list[int]], blocks: list[int], overhead: int) -> int:
    return sum(overhead + len(g) * max(blocks[i] for i in g) for g in groups)


def brute_force_best(blocks: list[int], overhead: int) -> int:
    """Least cost over every split of the rows sorted by block count into contiguous runs."""
    order = sorted(range(len(blocks)), key=lambda i: blocks[i])
    best = None
    for cuts in itertools.product([False, True], repeat=len(blocks) - 1):
        groups, current = [], [order[0]]
        for cut, row in zip(cuts, order[1:]):
            if cut:
                groups.append(current)
                current = []
            current.append(row)
        groups.append(current)
        c = cost(groups, blocks, overhead)
        best = c if best is None else min(best, c)
    return best


def test_similar_lengths_stay_in_one_group():
    assert plan_decode_groups([3, 4, 3, 5, 4]) == [[0, 2, 1, 4, 3]]
    assert plan_decode_groups([]) == [[]] and plan_decode_groups([7]) == [[0]]


def test_one_long_context_among_short_ones_gets_its_own_group():
    blocks = [3] * 15 + [40]
    assert plan_decode_groups(blocks, overhead=20) == [list(range(15)), [15]]
    # Not worth a call when the saving is below the overhead: 15 rows x 2 blocks saved < 40.
    assert plan_decode_groups([3] * 15 + [5], overhead=40) == [list(range(16))]


@pytest.mark.parametrize("seed", range(20))
def test_the_plan_is_the_cheapest_split(seed):
    import random

    rng = random.Random(seed)
    blocks = [rng.choice([1, 2, 3, 8, 20, 40, 41]) for _ in range(rng.randint(2, 9))]
    overhead = rng.choice([0, 5, 20, 100])
    groups = plan_decode_groups(blocks, overhead)
    assert sorted(i for g in groups for i in g) == list(range(len(blocks)))
    assert cost(groups, blocks, overhead) == brute_force_best(blocks, overhead)


def test_grouped_decode_attention_gives_the_same_outputs(tiny_dir, tokenizer, monkeypatch):
    """Contexts of very different lengths, decoded in one padded batch and then with every row in its own
    group: the same greedy tokens and logprobs (the same arithmetic per row, only the padding differs)."""
    prompts = [list(range(100, 100 + n)) for n in (5, 40, 150, 12, 300)]
    params = SamplingParams(max_tokens=10, ignore_eos=True)

    def run():
        engine = make_engine(tiny_dir, tokenizer, prefix_caching=False)
        return [(o.token_ids, o.logprobs) for o in engine.generate(prompts, params)]

    monkeypatch.setattr(model_runner, "plan_decode_groups", lambda blocks: [list(range(len(blocks)))])
    one_batch = run()
    calls = []

    def every_row_alone(blocks):
        calls.append(len(blocks))
        return [[i] for i in range(len(blocks))]

    monkeypatch.setattr(model_runner, "plan_decode_groups", every_row_alone)
    grouped = run()
    assert max(calls) >= 4  # steps with four or five rows decoding went through one group per row
    for (tokens_a, lp_a), (tokens_b, lp_b) in zip(one_batch, grouped):
        assert list(tokens_a) == list(tokens_b)
        assert lp_a == pytest.approx(lp_b, abs=1e-4)
