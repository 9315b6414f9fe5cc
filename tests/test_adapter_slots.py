"""Adapter slots: the torch-free table, the device pool in the engine, and adapter file validation."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import make_engine, write_peft_adapter
from loramux.adapters.peft_format import AdapterFormatError, load_adapter_dir
from loramux.adapters.slots import NoFreeSlotError, SlotTable
from loramux.engine.engine import RequestError
from loramux.engine.sampling_params import SamplingParams
from loramux.model.loader import read_model_config


def test_slot_table_pins_and_lru():
    table = SlotTable(2)
    assert table.acquire("a") == (0, True)
    assert table.acquire("b") == (1, True)
    assert table.acquire("a") == (0, False)  # resident: no load
    assert not table.can_acquire("c")  # both pinned
    with pytest.raises(NoFreeSlotError):
        table.acquire("c")
    table.release(1)  # b unpinned: the only candidate
    assert table.acquire("c") == (1, True) and table.slot_of("b") is None
    table.release(0)
    table.release(0)
    table.release(1)
    table.acquire("a")
    table.release(0)  # a used more recently than c
    assert table.acquire("d") == (1, True)  # evicts the least recently used unpinned slot (c)
    with pytest.raises(RuntimeError, match="released more often"):
        SlotTable(1).release(0)


@pytest.fixture
def tiny_cfg(tiny_dir):
    return read_model_config(tiny_dir)[0]


def lora_engine(tiny_dir, tokenizer, slots=2, **kw):
    return make_engine(tiny_dir, tokenizer, max_loras=slots, max_lora_rank=8, **kw)


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


def test_pinned_slot_is_never_evicted(tiny_dir, tokenizer, tiny_cfg, tmp_path):
    engine = lora_engine(tiny_dir, tokenizer, slots=2)
    for i in range(3):
        engine.load_adapter_dir(write_peft_adapter(tmp_path / f"a{i}", tiny_cfg, 4, ["q_proj", "v_proj"], seed=i,
                                                   b_std=1.0), f"a{i}")
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    engine.add_request("r0", "Hello", params, adapter="a0")
    engine.add_request("r1", "Hi", params, adapter="a1")
    engine.step()
    pinned = {engine.slots.key_of[s] for s in range(2)}
    engine.add_request("r2", "Hey", params, adapter="a2")  # no slot can be had while r0 and r1 run
    for _ in range(5):
        engine.step()
        assert {engine.slots.key_of[s] for s in range(2)} == pinned
        assert engine.requests["r2"].seq.lora_slot == -1
    engine.abort_request("r1")
    engine.step()  # now a2 takes r1's slot
    assert engine.requests["r2"].seq.lora_slot >= 0
    assert engine.adapters["a0"].digest in engine.slots.key_of


def test_cycling_many_adapters_keeps_memory_flat_and_outputs_stable(tiny_dir, tokenizer, tiny_cfg, tmp_path):
    engine = lora_engine(tiny_dir, tokenizer, slots=2)
    names = [f"a{i}" for i in range(20)]  # 10x more adapters than slots
    for i, name in enumerate(names):
        engine.load_adapter_dir(write_peft_adapter(tmp_path / name, tiny_cfg, 1 + i % 8, ["q_proj", "down_proj"],
                                                   seed=i, b_std=1.0), name)
    pool_bytes = engine.slot_pool.nbytes
    tensors_before = {id(w.a) for layer in engine.slot_pool.layers for w in layer.values()}
    first = {name: run(engine, "Hello world", name) for name in names}
    again = {name: run(engine, "Hello world", name) for name in reversed(names)}  # every one reloaded
    assert first == again
    assert engine.slots.loads >= 2 * len(names) - 2
    assert engine.slot_pool.nbytes == pool_bytes
    assert {id(w.a) for layer in engine.slot_pool.layers for w in layer.values()} == tensors_before
    base = run(engine, "Hello world", None)
    assert sum(first[n] != base for n in names) >= len(names) // 2  # adapters change the output
    assert engine.stats()["adapter_slots_pinned"] == 0


def test_batch_carries_adapters_and_base_rows_like_alone(tiny_dir, tokenizer, tiny_cfg, tmp_path):
    engine = lora_engine(tiny_dir, tokenizer, slots=3)
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


def test_failed_adapter_load_does_not_leave_the_slot_marked(tiny_dir, tokenizer, tiny_cfg, tmp_path, monkeypatch):
    engine = lora_engine(tiny_dir, tokenizer, slots=2)
    engine.load_adapter_dir(write_peft_adapter(tmp_path / "a", tiny_cfg, 4, ["q_proj"], seed=0, b_std=1.0), "a")
    good = run(engine, "Hello", "a")
    engine.slots.evict(engine.adapters["a"].digest)
    original = engine.slot_pool.load
    monkeypatch.setattr(engine.slot_pool, "load", lambda slot, adapter: (_ for _ in ()).throw(RuntimeError("dma")))
    engine.add_request("x", "Hello", SamplingParams(max_tokens=3), adapter="a")
    with pytest.raises(RuntimeError, match="dma"):
        engine.step()
    assert engine.adapters["a"].digest not in engine.slots.key_of
    engine.abort_request("x")
    monkeypatch.setattr(engine.slot_pool, "load", original)
    assert run(engine, "Hello", "a") == good  # reloaded properly on the next request


def test_config_declaring_more_targets_than_the_weights_is_refused(tiny_cfg, tmp_path):
    path = write_peft_adapter(tmp_path / "a", tiny_cfg, 4, ["q_proj"], seed=0)
    _mutate(path, {"target_modules": ["q_proj", "v_proj"]})
    with pytest.raises(AdapterFormatError, match="must be the same projections"):
        load_adapter_dir(path, tiny_cfg)


def test_reregistering_a_name_drops_the_old_version(tiny_dir, tokenizer, tiny_cfg, tmp_path):
    engine = lora_engine(tiny_dir, tokenizer, slots=2)
    v1 = engine.load_adapter_dir(write_peft_adapter(tmp_path / "v1", tiny_cfg, 4, ["q_proj"], seed=1, b_std=1.0), "a")
    out1 = run(engine, "Hello", "a")
    v2 = engine.load_adapter_dir(write_peft_adapter(tmp_path / "v2", tiny_cfg, 4, ["q_proj"], seed=2, b_std=1.0), "a")
    assert v1.digest != v2.digest and v1.digest not in engine._by_digest
    assert v1.digest not in engine.slots.key_of
    assert run(engine, "Hello", "a") != out1


def test_old_version_in_use_is_dropped_when_its_last_request_ends(tiny_dir, tokenizer, tiny_cfg, tmp_path):
    engine = lora_engine(tiny_dir, tokenizer, slots=2)
    v1 = engine.load_adapter_dir(write_peft_adapter(tmp_path / "v1", tiny_cfg, 4, ["q_proj"], seed=1), "a")
    engine.add_request("old", "Hello", SamplingParams(max_tokens=5, ignore_eos=True), adapter="a")
    engine.step()
    engine.load_adapter_dir(write_peft_adapter(tmp_path / "v2", tiny_cfg, 4, ["q_proj"], seed=2), "a")
    assert v1.digest in engine._by_digest  # still serving the running request
    while engine.has_unfinished():
        engine.step()
    assert v1.digest not in engine._by_digest and v1.digest not in engine.slots.key_of
