"""The engine on a tiny random Llama with the real SmolLM2 tokenizer."""
from __future__ import annotations

import pytest

from conftest import make_engine
from loramux.engine.engine import RequestError
from loramux.engine.sampling.params import SamplingParams

PROMPTS = ["Hello there, how are", "The quick brown fox", "1 2 3", "Once upon a time in a very distant land"]


def run_alone(engine, prompt, params):
    return engine.generate([prompt], params)[0]


def test_batched_greedy_equals_each_request_alone(tiny_engine):
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    alone = [run_alone(tiny_engine, p, params).token_ids for p in PROMPTS]
    together = [o.token_ids for o in tiny_engine.generate(PROMPTS, params)]
    assert together == alone


def test_requests_joining_mid_flight_and_preemption_keep_outputs(tiny_dir, tokenizer):
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    reference = make_engine(tiny_dir, tokenizer)
    expected = {p: run_alone(reference, p, params).token_ids for p in PROMPTS}
    # 10 blocks of 4 tokens: far too few for four sequences, so the scheduler must preempt and recompute.
    engine = make_engine(tiny_dir, tokenizer, num_blocks=10, block_size=4, max_num_batched_tokens=8,
                         max_num_seqs=4)
    pending = list(PROMPTS)
    engine.add_request(pending[0], pending.pop(0), params)
    finished, steps = {}, 0
    while engine.has_unfinished() or pending:
        if pending and steps % 3 == 2:  # a new request joins the running batch every few steps
            engine.add_request(pending[0], pending.pop(0), params)
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.token_ids
        steps += 1
        engine.block_manager.check_invariants(engine.scheduler.running)
    assert finished == expected
    assert engine.stats()["preemptions"] > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_max_tokens_and_finish_reason(tiny_engine):
    out = run_alone(tiny_engine, "Hello", SamplingParams(max_tokens=5, ignore_eos=True))
    assert len(out.token_ids) == 5 and out.finish_reason == "length"
    assert out.timings["ttft_ms"] is not None and out.timings["total_ms"] >= out.timings["ttft_ms"]


def test_eos_and_stop_token_ids_stop_generation(tiny_engine):
    free = run_alone(tiny_engine, "Hello", SamplingParams(max_tokens=8, ignore_eos=True))
    stop_at = free.token_ids[3]
    out = run_alone(tiny_engine, "Hello", SamplingParams(max_tokens=8, stop_token_ids=[stop_at]))
    assert out.finish_reason == "stop" and out.token_ids[-1] == stop_at
    assert out.token_ids == free.token_ids[: free.token_ids.index(stop_at) + 1]


def test_min_tokens_suppresses_stop_tokens(tiny_engine):
    free = run_alone(tiny_engine, "Hello", SamplingParams(max_tokens=8, ignore_eos=True))
    stop_at = free.token_ids[1]
    out = run_alone(tiny_engine, "Hello", SamplingParams(max_tokens=8, min_tokens=8, stop_token_ids=[stop_at]))
    assert len(out.token_ids) == 8 and stop_at not in out.token_ids and out.finish_reason == "length"


def test_stop_string_spanning_tokens_is_trimmed(tiny_engine, tokenizer):
    free = run_alone(tiny_engine, "The quick brown fox", SamplingParams(max_tokens=24, ignore_eos=True))
    text = free.text
    # A stop string that starts inside one token and ends inside a later one.
    pieces = [tokenizer.decode([t]) for t in free.token_ids]
    start = len(pieces[0]) + len(pieces[1]) - 1
    stop = text[start:start + len(pieces[2]) + 2]
    assert len(stop) >= 3
    out = run_alone(tiny_engine, "The quick brown fox", SamplingParams(max_tokens=24, stop=[stop], ignore_eos=True))
    assert out.finish_reason == "stop"
    assert out.text == text[: text.index(stop)]
    assert stop not in out.text


def test_streamed_deltas_concatenate_to_text_without_broken_characters(tiny_engine, tokenizer):
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=3, ignore_eos=True)
    tiny_engine.add_request("s", "東京は🦙", params)
    deltas, final = [], None
    while tiny_engine.has_unfinished():
        for out in tiny_engine.step():
            deltas.append(out.delta_text)
            final = out
    whole = tokenizer.decode(final.token_ids, skip_special_tokens=True)
    assert "".join(deltas) == final.text == whole
    # Random tokens may form byte sequences that are not UTF-8 at all (a replacement character in the whole
    # decode too); streaming must never add one by splitting a character that completes later.
    assert sum(d.count("\ufffd") for d in deltas) == whole.count("\ufffd")


def test_seeded_sampling_repeats_whatever_shares_the_batch(tiny_engine):
    params = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=42, ignore_eos=True)
    alone = run_alone(tiny_engine, "Hello", params).token_ids
    others = [SamplingParams(max_tokens=7, temperature=0.8, ignore_eos=True) for _ in range(3)]
    outs = tiny_engine.generate(["Hi", "Hello", "Hey there", "Yo"], [others[0], params, others[1], others[2]])
    assert outs[1].token_ids == alone
    assert run_alone(tiny_engine, "Hello", SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=43,
                                                          ignore_eos=True)).token_ids != alone


def test_logprobs_are_reported_per_token(tiny_engine):
    out = run_alone(tiny_engine, "Hello", SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out.logprobs) == 4 and all(lp <= 0.0 for lp in out.logprobs)


def test_cancel_frees_blocks_at_once(tiny_engine):
    tiny_engine.add_request("a", "Hello there", SamplingParams(max_tokens=50, ignore_eos=True))
    tiny_engine.add_request("b", "General Kenobi", SamplingParams(max_tokens=50, ignore_eos=True))
    tiny_engine.step()
    tiny_engine.step()
    used = tiny_engine.stats()["kv_blocks_used"]
    assert used > 0
    out = tiny_engine.abort_request("a")
    assert out.finished and out.finish_reason == "cancelled"
    assert tiny_engine.stats()["kv_blocks_used"] < used
    tiny_engine.abort_request("b")
    assert tiny_engine.stats()["kv_blocks_used"] == 0 and not tiny_engine.has_unfinished()


def test_deadline_ends_request_with_partial_output(tiny_engine):
    tiny_engine.add_request("t", "Hello", SamplingParams(max_tokens=100, ignore_eos=True, timeout_s=60))
    for _ in range(3):
        tiny_engine.step()
    seq = tiny_engine.requests["t"].seq
    seq.deadline = 0.0  # the deadline passes (no sleeping in tests)
    outs = tiny_engine.step()
    assert [o.finish_reason for o in outs] == ["timeout"]
    assert len(outs[0].token_ids) == 3 and tiny_engine.stats()["kv_blocks_used"] == 0


def test_bad_requests_are_refused_clearly(tiny_engine):
    with pytest.raises(RequestError, match="at most 511 prompt tokens"):
        tiny_engine.add_request("long", list(range(5, 600)), SamplingParams())
    with pytest.raises(RequestError, match="empty"):
        tiny_engine.add_request("empty", [], SamplingParams())
    tiny_engine.add_request("dup", "x", SamplingParams(max_tokens=1))
    with pytest.raises(RequestError, match="already in use"):
        tiny_engine.add_request("dup", "y", SamplingParams())
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)


def test_context_length_limit_finishes_with_length(tiny_dir, tokenizer):
    engine = make_engine(tiny_dir, tokenizer, max_model_len=20)
    out = engine.generate([list(range(5, 15))], SamplingParams(max_tokens=100, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 10


def test_a_sequence_never_outgrows_the_kv_pool(tiny_dir, tokenizer):
    # 4 blocks of 4 tokens: max_model_len shrinks to 16 so one sequence always fits the pool alone.
    engine = make_engine(tiny_dir, tokenizer, num_blocks=4, block_size=4, max_num_batched_tokens=32)
    assert engine.max_model_len == 16
    out = engine.generate([list(range(5, 15))], SamplingParams(max_tokens=100, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 6
    assert engine.stats()["kv_blocks_used"] == 0


def test_bad_token_ids_are_refused(tiny_engine):
    with pytest.raises(RequestError, match="token ids must be in"):
        tiny_engine.add_request("big", [10**9], SamplingParams())
    with pytest.raises(RequestError, match="token ids must be in"):
        tiny_engine.add_request("stop", [5], SamplingParams(stop_token_ids=[10**9]))
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[-1])
    assert not tiny_engine.has_unfinished()


def test_a_local_adapter_follows_the_upload_base_model_rule(tiny_dir, tokenizer, tiny_cfg, tmp_path):
    """`loramux generate --adapter` loads through LLMEngine.load_adapter_dir: the same base-model rule as
    an upload (another hub model is refused unless allowed; a local copy's path is fine)."""
    import json

    from loramux.adapters.formats.validation import AdapterFormatError
    from loramux.testing import write_peft_adapter

    engine = make_engine(tiny_dir, tokenizer, max_loras=2, max_lora_rank=8)
    engine.model_name = "/models/SmolLM2-135M-Instruct"
    for i, (claimed, ok) in enumerate([("meta-llama/Llama-2-7b-hf", False),
                                       ("/home/me/checkpoints/SmolLM2-135M-Instruct", True),
                                       ("HuggingFaceTB/SmolLM2-135M-Instruct", True)]):
        path = write_peft_adapter(tmp_path / f"a{i}", tiny_cfg, 4, ["q_proj"], seed=i)
        config = json.loads((path / "adapter_config.json").read_text())
        (path / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": claimed}))
        if ok:
            engine.load_adapter_dir(path, f"a{i}")
            continue
        with pytest.raises(AdapterFormatError) as info:
            engine.load_adapter_dir(path, f"a{i}")
        assert info.value.code == "base_model_mismatch" and "allow_base_mismatch" in str(info.value)
        engine.load_adapter_dir(path, f"a{i}", allow_base_mismatch=True)


def test_decodes_held_back_for_a_below_share_tenant_keep_outputs(tiny_dir, tokenizer):
    """Tenant a holds 3 of 4 slots (above its share of 2 once b has work): the step that starts b's prompt
    leaves a's decodes out (fair share's first token); every request's greedy tokens stay as if run alone."""
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    reference = make_engine(tiny_dir, tokenizer)
    expected = {p: run_alone(reference, p, params).token_ids for p in PROMPTS}
    engine = make_engine(tiny_dir, tokenizer, max_num_seqs=4)
    schedule, batches = engine.scheduler.schedule, []

    def recorded(now=None):
        batches.append(batch := schedule(now))
        return batch

    engine.scheduler.schedule = recorded
    for p in PROMPTS[:3]:
        engine.add_request(p, p, params, tenant="a")
    finished = {}
    for steps in range(100):
        if steps == 3:
            engine.add_request(PROMPTS[3], PROMPTS[3], params, tenant="b")
        finished.update({out.request_id: out.token_ids for out in engine.step() if out.finished})
        if not engine.has_unfinished():
            break
    assert finished == expected
    b_step = next(b for b in batches if any(seq.tenant == "b" for seq, _ in b.prefills))
    assert b_step.decodes == []
