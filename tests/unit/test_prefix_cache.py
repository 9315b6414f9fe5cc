"""Automatic prefix caching: block bookkeeping under random load, outputs identical with caching on
and off across base and adapters, no sharing across adapter versions or tenants, and a pool that
drains back to free."""
from __future__ import annotations

import random

import pytest
import torch

from conftest import make_engine, run_to_completion
from loramux.adapters.formats.peft import load_adapter_dir
from loramux.engine.sampling.params import SamplingParams
from loramux.engine.scheduling.block_manager import BlockManager
from loramux.engine.sequence import Sequence
from loramux.model.loader import read_model_config
from loramux.testing import save_tiny_hf_model, write_peft_adapter


def make_seq(rid: str, tokens: list[int], salt: str = "base|") -> Sequence:
    return Sequence(rid, tokens, SamplingParams(max_tokens=8), cache_salt=salt)


def test_blocks_are_shared_by_content_and_salt_only():
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    first = make_seq("a", list(range(10)))
    assert bm.match_prefix(first) == []
    bm.admit(first, [], 10)
    first.num_computed_tokens = 10
    bm.commit(first)
    assert bm.num_cached_blocks == 2  # two full blocks of 4; the partial third is not cached
    same = make_seq("b", list(range(10)))
    hits = bm.match_prefix(same)
    assert hits == first.block_table[:2]
    assert make_seq("c", list(range(9))).num_tokens == 9 and bm.match_prefix(make_seq("c", list(range(9)))) == hits
    assert bm.match_prefix(make_seq("d", list(range(8)))) == hits[:1]  # the last prompt token is always computed
    assert bm.match_prefix(make_seq("e", [99] + list(range(1, 10)))) == []  # chained: a different first block
    assert bm.match_prefix(make_seq("f", list(range(10)), salt="digest-A|")) == []
    assert bm.match_prefix(make_seq("g", list(range(10)), salt="base|tenant-2")) == []
    bm.admit(same, hits, 2)
    assert bm.ref_counts[hits[0]] == 2 and same.num_computed_tokens == 8
    bm.free(first)
    bm.free(same)
    bm.check_invariants([])
    assert bm.num_used_blocks == 0 and bm.num_cached_blocks == 2  # cached blocks count as free


def test_cached_blocks_are_evicted_lru_when_room_is_needed():
    bm = BlockManager(4, 2, enable_prefix_caching=True)
    for i, base in enumerate((0, 100)):
        seq = make_seq(f"s{i}", [base, base + 1, base + 2, base + 3])
        bm.admit(seq, [], 4)
        seq.num_computed_tokens = 4
        bm.commit(seq)
        bm.free(seq)
    assert bm.num_cached_blocks == 4 and bm.num_free_blocks == 4
    big = make_seq("big", list(range(500, 507)))
    bm.admit(big, [], 7)  # needs all four blocks: every cached block is evicted
    assert bm.num_cached_blocks == 0 and bm.num_free_blocks == 0
    bm.check_invariants([big])


def test_no_leak_or_corruption_after_2000_random_events():
    rng = random.Random(0)
    bm = BlockManager(64, 4, enable_prefix_caching=True)
    prefixes = [[rng.randrange(50) for _ in range(12)] for _ in range(4)]
    live: list[Sequence] = []
    for step in range(2000):
        action = rng.random()
        if action < 0.45 or not live:
            tokens = rng.choice(prefixes)[: rng.randrange(1, 13)] + [rng.randrange(50) for _ in range(rng.randrange(6))]
            seq = make_seq(f"r{step}", tokens, salt=rng.choice(["base|", "A|", "A|t2"]))
            hits = bm.match_prefix(seq)
            remaining = seq.num_tokens - len(hits) * 4
            if bm.can_admit(seq, hits, remaining + 1):
                bm.admit(seq, hits, remaining)
                live.append(seq)
        elif action < 0.8:
            seq = rng.choice(live)
            if seq.num_computed_tokens < seq.num_tokens:
                seq.num_computed_tokens = min(seq.num_tokens, seq.num_computed_tokens + rng.randrange(1, 6))
            elif bm.can_allocate(seq, 1):
                bm.allocate(seq, 1)
                seq.num_computed_tokens += 1
                seq.output_token_ids.append(rng.randrange(50))
            bm.commit(seq)
        else:
            seq = live.pop(rng.randrange(len(live)))
            bm.free(seq)
        bm.check_invariants(live)
        for seq in live:  # every shared block holds the tokens this sequence expects
            for i, digest in enumerate(seq.block_hashes[: seq.num_computed_tokens // 4]):
                block = seq.block_table[i]
                assert bm.block_hash[block] in (None, digest)
    for seq in live:
        bm.free(seq)
    bm.check_invariants([])
    assert bm.num_used_blocks == 0


@pytest.fixture(scope="module")
def long_model(tmp_path_factory, tokenizer):
    path = tmp_path_factory.mktemp("tiny-long")
    save_tiny_hf_model(path, vocab_size=len(tokenizer), max_position_embeddings=1024)
    cfg, _ = read_model_config(path)
    adapters = {}
    for name, seed in (("A", 1), ("B", 2), ("A2", 3)):
        d = write_peft_adapter(path.parent / f"{path.name}-{name}", cfg, 4, ["q_proj", "k_proj", "v_proj", "down_proj"],
                               seed=seed, b_std=0.5)
        adapters[name] = load_adapter_dir(d, cfg, name=name)
    return path, adapters


def run_interleaved(engine, adapters, prompts) -> list:
    """Every (prompt, adapter name or None) request at once; finished outputs in request order."""
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    return run_to_completion(engine, [(prompt, params, adapters[which] if which else None)
                                      for prompt, which in prompts])


def test_200_requests_sharing_a_512_token_prefix_match_caching_off(long_model, tokenizer):
    path, adapters = long_model
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(100, 40000, (512,), generator=g).tolist()
    prompts = [(prefix + torch.randint(100, 40000, (32,), generator=g).tolist(), [None, "A", "B"][i % 3])
               for i in range(200)]
    results = {}
    for caching in (False, True):
        # Inline adapter loads: with a helper thread, when an adapter lands decides how many of its requests
        # share its first prefill (and so miss the cache), which made the count below depend on timing.
        engine = make_engine(path, tokenizer, prefix_caching=caching, max_loras=3, max_lora_rank=8,
                             num_blocks=512, max_model_len=1024, max_num_batched_tokens=1024,
                             async_adapter_loads=False)
        results[caching] = run_interleaved(engine, adapters, prompts)
        assert engine.block_manager.num_used_blocks == 0  # load stopped: every block back in the free pool
        if caching:
            cached_engine = engine
    assert [o.token_ids for o in results[True]] == [o.token_ids for o in results[False]]
    cached = [o.num_cached_tokens for o in results[True]]
    assert all(c == 0 for c in (o.num_cached_tokens for o in results[False]))
    assert sum(c == 512 for c in cached) >= 190  # all but the first of each adapter (and any that raced it)
    assert cached_engine.block_manager.num_cached_blocks > 0

    # A re-upload is a new version (new digest): none of A's old blocks may serve it.
    out = run_interleaved(cached_engine, {"A": adapters["A2"]}, [(prompts[1][0], "A")])[0]
    assert out.num_cached_tokens == 0
    again = run_interleaved(cached_engine, {"A": adapters["A2"]}, [(prompts[4][0], "A")])[0]
    assert again.num_cached_tokens == 512  # its own blocks are reused from then on
    assert cached_engine.block_manager.num_used_blocks == 0


def test_tenants_do_not_share_blocks_unless_isolation_is_off(long_model, tokenizer):
    path, _ = long_model
    engine = make_engine(path, tokenizer, num_blocks=128, max_model_len=1024)
    prompt = list(range(1000, 1100))
    params = SamplingParams(max_tokens=2, ignore_eos=True)

    def cached_tokens(salt):
        engine.add_request(f"q{salt}-{engine.block_manager.hits}", prompt, params, cache_salt=salt)
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    return out.num_cached_tokens

    assert cached_tokens("tenant-1") == 0
    assert cached_tokens("tenant-1") == 96
    assert cached_tokens("tenant-2") == 0
