"""Sliding-window attention in the paged KV path (Mistral v0.1's `sliding_window` on every layer): output equal
to HF's past the window with prefix caching and speculation on, and the blocks that left every window
given back to the pool while the sequence runs."""
from __future__ import annotations

import pytest
import torch

from loramux.engine.config import EngineConfig
from loramux.engine.engine import LLMEngine
from loramux.engine.sampling.params import SamplingParams
from loramux.engine.scheduling.block_manager import RELEASED, BlockManager
from loramux.engine.sequence import Sequence
from loramux.model.loader import build_model, end_of_turn_ids
from loramux.testing import save_tiny_hf_model

WINDOW, BLOCK = 8, 4


def test_blocks_that_left_the_window_go_back_to_the_pool_and_stay_cached():
    blocks = BlockManager(16, BLOCK, enable_prefix_caching=True, sliding_window=WINDOW)
    seq = Sequence("r", list(range(20)), SamplingParams(max_tokens=4))
    blocks.allocate(seq, 20)
    seq.num_computed_tokens = 20
    blocks.commit(seq)
    # The next query (position 20) sees keys 13..20: blocks 0-2 (positions 0..11) are out of every window.
    assert blocks.release_out_of_window(seq) == 3
    assert seq.block_table[:3] == [RELEASED] * 3 and RELEASED not in seq.block_table[3:]
    assert blocks.num_used_blocks == 2
    blocks.check_invariants([seq])
    assert blocks.release_out_of_window(seq) == 0  # idempotent
    # Released blocks keep their hashes: a new prompt with the same prefix still finds them.
    other = Sequence("o", list(range(20)), SamplingParams(max_tokens=4))
    assert len(blocks.match_prefix(other)) == 4
    blocks.free(seq)
    assert blocks.num_used_blocks == 0
    blocks.check_invariants([])


def test_no_window_or_a_mixed_model_releases_nothing():
    blocks = BlockManager(16, BLOCK)
    seq = Sequence("r", list(range(20)), SamplingParams(max_tokens=4))
    blocks.allocate(seq, 20)
    seq.num_computed_tokens = 20
    assert blocks.release_out_of_window(seq) == 0 and RELEASED not in seq.block_table


@pytest.fixture(scope="module")
def windowed(tmp_path_factory, tokenizer):
    path = tmp_path_factory.mktemp("mistral-window")
    hf = save_tiny_hf_model(path, len(tokenizer), "mistral", weight_scale=4.0, sliding_window=WINDOW)
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    return path, hf


@pytest.mark.parametrize("speculative_tokens", [0, 3])
def test_long_generation_equals_hf_and_holds_only_the_window(windowed, tokenizer, speculative_tokens):
    path, hf = windowed
    model, cfg = build_model(path, torch.float32, torch.device("cpu"))
    assert cfg.sliding_window == WINDOW
    engine = LLMEngine(model, tokenizer, EngineConfig(block_size=BLOCK, num_blocks=64, max_num_seqs=4,
                                                      max_num_batched_tokens=16, max_model_len=256,
                                                      speculative_tokens=speculative_tokens,
                                                      async_adapter_loads=False),
                       end_of_turn_ids(tokenizer, cfg, path))
    prompt = list(range(300, 330)) + list(range(300, 306))  # 36 tokens (chunked by 16), one repeat to draft from
    with torch.inference_mode():
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False)[0, len(prompt):].tolist()
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    for round_ in range(2):  # the second round starts from the prefix cache
        engine.add_request(f"r{round_}", prompt, params)
        most_live, result = 0, None
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    result = out.token_ids
            engine.block_manager.check_invariants(engine.scheduler.running)
            for seq in engine.scheduler.running:
                if not seq.is_prefill:
                    most_live = max(most_live, sum(b != RELEASED for b in seq.block_table))
        assert result == expected, round_
        # A decoding sequence holds the window plus the blocks its next tokens go to, not its whole context.
        assert 0 < most_live <= WINDOW // BLOCK + 2 + speculative_tokens // BLOCK + 1, most_live
    assert engine.stats()["prefix_cache_hit_blocks"] > 0
    assert engine.stats()["kv_blocks_used"] == 0
