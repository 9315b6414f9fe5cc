"""The device adapter pool in the engine: adapters at their own ranks within a byte budget, loads off the
engine's critical path, bounded waits and loads with more adapters than fit, and adapter file validation."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import decode_step_lora_cost, make_engine
from loramux.adapters.formats.peft import AdapterFormatError, load_adapter_dir
from loramux.engine.engine import RequestError
from loramux.engine.sampling.params import SamplingParams
from loramux.model.llama import LORA_MODULES, PROJECTION_SLICES
from loramux.testing import write_peft_adapter


def lora_engine(tiny_dir, tokenizer, fit: int | None = None, rank: int = 8, targets=("q_proj",), **kw):
    """An engine whose pool holds `fit` adapters of `rank` on `targets` (None: the default budget); copies
    inline."""
    kw.setdefault("async_adapter_loads", False)
    kw.setdefault("adapter_min_residency_s", 0.0)
    engine = make_engine(tiny_dir, tokenizer, max_lora_rank=kw.pop("max_lora_rank", 8), **kw)
    if fit is not None:
        paths = {PROJECTION_SLICES[t][0] for t in targets}
        engine.pool.budget = fit * engine.pool.slot_bytes((rank, tuple(p for p in LORA_MODULES if p in paths)))
    return engine


def run(engine, prompt, adapter, tokens=6):
    return engine.generate([prompt], SamplingParams(max_tokens=tokens, ignore_eos=True))[0].token_ids \
        if adapter is None else _run_adapter(engine, prompt, adapter, tokens)


def _run_adapter(engine, prompt, adapter, tokens):
    engine.add_request("x", prompt, SamplingParams(max_tokens=tokens, ignore_eos=True), adapter=adapter)
    out = None
    while engine.has_unfinished():
        for o in engine.step():
            out = o
    return out.token_ids


def test_running_adapters_stay_while_a_third_waits(tiny_dir, tokenizer, tiny_cfg, tmp_path):
    engine = lora_engine(tiny_dir, tokenizer, fit=2, rank=4)
    for i in range(3):
        engine.load_adapter_dir(write_peft_adapter(tmp_path / f"a{i}", tiny_cfg, 4, ["q_proj", "v_proj"], seed=i,
                                                   b_std=1.0), f"a{i}")
    digests = [engine.adapters.by_name[f"a{i}"] for i in range(3)]
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    engine.add_request("r0", "Hello", params, adapter="a0")
    engine.add_request("r1", "Hi", params, adapter="a1")
    engine.step()
    engine.add_request("r2", "Hey", params, adapter="a2")  # no room while r0 and r1 run
    for _ in range(5):
        engine.step()
        assert engine.adapter_residency(digests[0]) == engine.adapter_residency(digests[1]) == "device"
        assert engine.adapter_residency(digests[2]) is None and not engine.requests["r2"].seq.adapter_leased
    engine.abort_request("r1")
    engine.step()  # a2 takes a1's room
    engine.step()
    assert engine.requests["r2"].seq.adapter_leased and engine.adapter_residency(digests[2]) == "device"
    assert engine.adapter_residency(digests[0]) == "device" and engine.adapter_residency(digests[1]) is None


def test_cycling_many_adapters_keeps_memory_in_budget_and_outputs_stable(tiny_dir, tokenizer, tiny_cfg, tmp_path):
    engine = lora_engine(tiny_dir, tokenizer, fit=3, rank=8, targets=("q_proj", "down_proj"))
    names = [f"a{i}" for i in range(20)]  # ranks 1..8 in a pool that holds 3 rank-8 adapters
    for i, name in enumerate(names):
        engine.load_adapter_dir(write_peft_adapter(tmp_path / name, tiny_cfg, 1 + i % 8, ["q_proj", "down_proj"],
                                                   seed=i, b_std=1.0), name)
    first = {name: run(engine, "Hello world", name) for name in names}
    assert engine.pool.nbytes <= engine.pool.budget
    again = {name: run(engine, "Hello world", name) for name in reversed(names)}  # most reloaded
    assert first == again
    assert engine.adapters.loads >= len(names) + len(names) - 3 - 8  # evicted ones came back
    assert engine.pool.nbytes <= engine.pool.budget
    base = run(engine, "Hello world", None)
    assert sum(first[n] != base for n in names) >= len(names) // 2  # adapters change the output
    assert engine.stats()["adapter_slots_pinned"] == 0


def test_batch_carries_adapters_and_base_rows_like_alone(tiny_dir, tokenizer, tiny_cfg, tmp_path):
    engine = lora_engine(tiny_dir, tokenizer)
    for i, targets in enumerate([["q_proj"], ["gate_proj", "up_proj"], ["k_proj", "o_proj", "down_proj"]]):
        engine.load_adapter_dir(write_peft_adapter(tmp_path / f"a{i}", tiny_cfg, 2 + 2 * i, targets, seed=i,
                                                   b_std=1.0), f"a{i}")
    plan = [("Hello", "a0"), ("Hello", None), ("The cat", "a1"), ("Hello", "a2"), ("The cat", "a0"), ("Hi", None)]
    alone = [run(engine, p, a) for p, a in plan]
    for i, (p, a) in enumerate(plan):
        engine.add_request(f"m{i}", p, SamplingParams(max_tokens=6, ignore_eos=True), adapter=a)
    finished = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.token_ids
    assert [finished[f"m{i}"] for i in range(len(plan))] == alone


def test_unknown_adapter_and_rank_limit(tiny_dir, tokenizer, tiny_cfg, tmp_path):
    engine = lora_engine(tiny_dir, tokenizer)
    with pytest.raises(RequestError, match="unknown adapter 'nope'"):
        engine.add_request("r", "Hi", SamplingParams(), adapter="nope")
    big = write_peft_adapter(tmp_path / "big", tiny_cfg, 16, ["q_proj"], seed=0)
    with pytest.raises(AdapterFormatError, match="rank 16 is above this server's maximum LoRA rank 8"):
        engine.load_adapter_dir(big)


def _mutate(path, config_changes=None):
    config = json.loads((path / "adapter_config.json").read_text())
    config.update(config_changes or {})
    (path / "adapter_config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("changes,message", [
    ({"use_dora": True}, "DoRA"),
    ({"peft_type": "IA3"}, "peft_type must be LORA"),
    ({"r": 0}, "r must be a positive integer"),
    ({"lora_alpha": -1}, "lora_alpha must be a positive number"),
    ({"rank_pattern": {"q_proj": 8}}, "rank_pattern"),
    ({"target_modules": ["k_proj"]}, "declares"),
    ({"r": 8}, "for r=8 on this base model"),
])
def test_bad_adapter_configs_are_refused(tiny_cfg, tmp_path, changes, message):
    path = write_peft_adapter(tmp_path / "a", tiny_cfg, 4, ["q_proj"], seed=0)
    _mutate(path, changes)
    with pytest.raises(AdapterFormatError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_adapter_dir(path, tiny_cfg)


def test_bad_adapter_weights_are_refused(tiny_cfg, tmp_path):
    from safetensors.torch import load_file, save_file

    path = write_peft_adapter(tmp_path / "a", tiny_cfg, 4, ["q_proj"], seed=0)
    tensors = load_file(path / "adapter_model.safetensors")
    name = next(n for n in tensors if n.endswith("lora_B.weight"))
    tensors[name][0, 0] = float("nan")
    save_file(tensors, path / "adapter_model.safetensors")
    with pytest.raises(AdapterFormatError, match="NaN"):
        load_adapter_dir(path, tiny_cfg)
    save_file({"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64)}, path / "adapter_model.safetensors")
    with pytest.raises(AdapterFormatError, match="lm_head"):
        load_adapter_dir(path, tiny_cfg)
    (path / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(AdapterFormatError, match="not a valid safetensors"):
        load_adapter_dir(path, tiny_cfg)
    (path / "adapter_model.safetensors").unlink()
    (path / "adapter_model.bin").write_bytes(b"pickle")
    with pytest.raises(AdapterFormatError, match="pickle weights"):
        load_adapter_dir(path, tiny_cfg)


def test_failed_device_copy_is_retried_and_leaves_nothing_behind(tiny_dir, tokenizer, tiny_cfg, tmp_path,
                                                                monkeypatch):
    engine = lora_engine(tiny_dir, tokenizer)
    engine.load_adapter_dir(write_peft_adapter(tmp_path / "a", tiny_cfg, 4, ["q_proj"], seed=0, b_std=1.0), "a")
    good = run(engine, "Hello", "a")
    fresh = lora_engine(tiny_dir, tokenizer)
    fresh.load_adapter_dir(tmp_path / "a", "a")
    original, failures = fresh.pool._write, []

    def flaky(bucket, slot, adapter):
        if not failures:
            failures.append(slot)
            raise RuntimeError("dma")
        original(bucket, slot, adapter)

    monkeypatch.setattr(fresh.pool, "_write", flaky)
    assert run(fresh, "Hello", "a") == good  # the first copy failed; the next step copied it again
    assert failures and fresh.adapters.load_failures == 1 and fresh.adapters.loads == 2


def test_config_declaring_more_targets_than_the_weights_is_refused(tiny_cfg, tmp_path):
    path = write_peft_adapter(tmp_path / "a", tiny_cfg, 4, ["q_proj"], seed=0)
    _mutate(path, {"target_modules": ["q_proj", "v_proj"]})
    with pytest.raises(AdapterFormatError, match="must be the same projections"):
        load_adapter_dir(path, tiny_cfg)


def test_reregistering_a_name_drops_the_old_version(tiny_dir, tokenizer, tiny_cfg, tmp_path):
    engine = lora_engine(tiny_dir, tokenizer)
    v1 = engine.load_adapter_dir(write_peft_adapter(tmp_path / "v1", tiny_cfg, 4, ["q_proj"], seed=1, b_std=1.0), "a")
    out1 = run(engine, "Hello", "a")
    v2 = engine.load_adapter_dir(write_peft_adapter(tmp_path / "v2", tiny_cfg, 4, ["q_proj"], seed=2, b_std=1.0), "a")
    assert v1.digest != v2.digest and v1.digest not in engine.adapters.entries
    assert run(engine, "Hello", "a") != out1


def test_old_version_in_use_is_dropped_when_its_last_request_ends(tiny_dir, tokenizer, tiny_cfg, tmp_path):
    engine = lora_engine(tiny_dir, tokenizer)
    v1 = engine.load_adapter_dir(write_peft_adapter(tmp_path / "v1", tiny_cfg, 4, ["q_proj"], seed=1), "a")
    engine.add_request("old", "Hello", SamplingParams(max_tokens=5, ignore_eos=True), adapter="a")
    engine.step()
    engine.load_adapter_dir(write_peft_adapter(tmp_path / "v2", tiny_cfg, 4, ["q_proj"], seed=2), "a")
    assert engine.adapter_residency(v1.digest) == "device"  # still serving the running request
    while engine.has_unfinished():
        engine.step()
    assert v1.digest not in engine.adapters.entries and engine.adapter_residency(v1.digest) is None


def test_rank_8_and_rank_64_in_one_batch_cost_their_own_ranks(tiny_dir, tokenizer, tiny_cfg, tmp_path):
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    engine = lora_engine(tiny_dir, tokenizer, max_lora_rank=64)
    for rank in (8, 64):
        path = write_peft_adapter(tmp_path / f"r{rank}", tiny_cfg, rank, targets, seed=rank)
        engine.load_adapter_dir(path, f"r{rank}")
    alone8 = decode_step_lora_cost(engine, {"x": "r8"}, "Hello there")
    alone64 = decode_step_lora_cost(engine, {"y": "r64"}, "Hello there")
    together = decode_step_lora_cost(engine, {"x": "r8", "y": "r64"}, "Hello there")
    assert alone8[0] > 0 and alone64 == (8 * alone8[0], 8 * alone8[1])  # cost is linear in the own rank
    assert together == (alone8[0] + alone64[0], alone8[1] + alone64[1])  # no padding to the larger rank
    # What one rank-64 row costs, by the model's shapes: rank x (d_in + d_out) summed over the projections.
    per_rank = sum((m.in_features * len(m.slices) + m.out_features) for _, _, m in engine.model.lora_modules())
    assert alone64[0] == 64 * per_rank


def test_device_copies_run_beside_the_engine(tiny_dir, tokenizer, tiny_cfg, tmp_path, monkeypatch):
    import threading

    engine = lora_engine(tiny_dir, tokenizer, async_adapter_loads=True)
    engine.load_adapter_dir(write_peft_adapter(tmp_path / "a", tiny_cfg, 4, ["q_proj"], seed=0, b_std=1.0), "a")
    release, original = threading.Event(), engine.pool._write

    def slow(bucket, slot, adapter):
        assert release.wait(30), "the test never released the copy"
        original(bucket, slot, adapter)

    monkeypatch.setattr(engine.pool, "_write", slow)
    engine.add_request("lora", "Hello", SamplingParams(max_tokens=3, ignore_eos=True), adapter="a")
    engine.add_request("base", "Hello", SamplingParams(max_tokens=3, ignore_eos=True))
    done = {}
    while "base" not in done:  # the base request runs to the end while the adapter's copy is held
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert engine.adapter_residency(engine.adapters.by_name["a"]) == "loading" and "lora" not in done
    release.set()
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert len(done["lora"].token_ids) == 3 and engine.stats()["lora"]["load_seconds"]["count"] == 1


def test_more_adapters_than_fit_finish_in_priority_order_with_bounded_waits_and_loads(tiny_dir, tokenizer,
                                                                                     tiny_cfg, tmp_path):
    """16 adapters, room for 4 on the device, 48 requests from three tiers all queued at once. Bounds:
    every adapter must be copied in at least once (16 loads): at most 25% more are allowed. A request of
    priority p waits at most the steps the work of priority >= p needs at max_num_seqs per step, plus one
    step per adapter it needs loaded, plus one request's length (the batch it finds running)."""
    seqs, new_tokens, adapters = 8, 6, 16
    # Drains are wall-clock (adapter_drain_after_s): off here, so a slow machine cannot add loads; no request
    # starves without them (running requests end within new_tokens steps and free their slots).
    engine = lora_engine(tiny_dir, tokenizer, fit=4, rank=4, max_num_seqs=seqs, adapter_drain_after_s=1e9)
    for i in range(adapters):
        engine.load_adapter_dir(write_peft_adapter(tmp_path / f"a{i}", tiny_cfg, 4, ["q_proj", "v_proj"], seed=i),
                                f"a{i}")
    priority_of = {i: i % 3 for i in range(adapters)}  # tenants of three tiers, four or five adapters each
    submitted = {}
    for round_ in range(3):
        for i in range(adapters):
            rid = f"a{i}-{round_}"
            engine.add_request(rid, "Hello", SamplingParams(max_tokens=new_tokens, ignore_eos=True),
                               priority=priority_of[i], adapter=f"a{i}")
            submitted[rid] = priority_of[i]
    first_step, finished, step = {}, {}, 0
    while engine.has_unfinished():
        step += 1
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        for rid, req in engine.requests.items():
            if req.seq.adapter_leased:
                first_step.setdefault(rid, step)
    assert all(finished[rid].finish_reason == "length" for rid in submitted)
    assert engine.adapters.loads <= 1.25 * adapters
    for priority in (2, 1, 0):
        ahead = [r for r, p in submitted.items() if p >= priority]
        loads = len({r.split("-")[0] for r in ahead})
        bound = -(-len(ahead) * (1 + new_tokens) // seqs) + loads + new_tokens
        waits = [first_step[r] for r, p in submitted.items() if p == priority]
        assert max(waits) <= bound, (priority, max(waits), bound)
    assert engine.stats()["lora"]["running"] == [] and engine.block_manager.num_used_blocks == 0


def test_a_request_starved_by_busy_adapters_drains_one_and_runs(tiny_dir, tokenizer, tiny_cfg, tmp_path):
    """Two adapters fill the pool and always have running requests (new ones keep arriving). A request
    for a third, queued longer than adapter_drain_after_s, gets room within one request's length + 2."""
    import time

    def serve(drain_after_s: float) -> int | None:
        engine = lora_engine(tiny_dir, tokenizer, fit=2, rank=4, adapter_drain_after_s=drain_after_s)
        for name in ("a", "b", "c"):
            engine.load_adapter_dir(tmp_path / name, name)
        params = SamplingParams(max_tokens=5, ignore_eos=True)
        for n in range(2):
            engine.add_request(f"a{n}", "Hi", params, adapter="a")
            engine.add_request(f"b{n}", "Hi", params, adapter="b")
        engine.step()
        engine.add_request("c", "Hi", params, adapter="c", arrival=time.monotonic() - 10)  # waited long
        for step in range(1, 40):
            engine.add_request(f"a-{step}", "Hi", params, adapter="a")
            engine.add_request(f"b-{step}", "Hi", params, adapter="b")
            engine.step()
            if "c" in engine.requests and engine.requests["c"].seq.adapter_leased:
                return step
        return None

    for name in ("a", "b", "c"):
        write_peft_adapter(tmp_path / name, tiny_cfg, 4, ["q_proj"], seed=ord(name))
    assert serve(drain_after_s=float("inf")) is None  # without drains it would wait for ever
    assert serve(drain_after_s=1.0) <= 5 + 2


def test_triton_kernels_serve_mixed_ranks_like_the_torch_path(tiny_dir, tokenizer, tiny_cfg, tmp_path):
    """The engine on the Triton kernels (interpreted on CPU) with ranks 4, 8 and 16 in one batch: the same
    tokens as the torch path. Each bucket is one launch at its own rank."""
    pytest.importorskip("triton")
    specs = {"r4": (4, ["q_proj", "v_proj"]), "r8": (8, ["o_proj", "down_proj"]), "r16": (16, ["gate_proj", "k_proj"])}
    for i, (name, (rank, targets)) in enumerate(specs.items()):
        write_peft_adapter(tmp_path / name, tiny_cfg, rank, targets, seed=i, b_std=1.0)
    outputs = {}
    for impl in ("torch", "triton"):
        engine = lora_engine(tiny_dir, tokenizer, max_lora_rank=16, lora_impl=impl)
        for name in specs:
            engine.load_adapter_dir(tmp_path / name, name)
        for name in [*specs, None]:
            engine.add_request(f"{name}", "Hello", SamplingParams(max_tokens=4, ignore_eos=True), adapter=name)
        done = {}
        while engine.has_unfinished():
            done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
        outputs[impl] = done
    assert outputs["triton"] == outputs["torch"]
