"""Fixed-shape decode (loramux.engine.cuda_graphs): the static-buffer path gives the eager path's logits and
tokens with adapters of two ranks in one batch; padding never touches real KV; graphs are dropped and
captured again when the pool's buckets change; a failed or wrong capture falls back to eager steps; the BGMV
kernels (Triton in the interpreter, torch) match a float64 reference.

On CPU the path runs two ways: eagerly from the buffers (capture=False), and through the capture/replay
logic with `RerunGraphs` standing in for torch.cuda graphs (its "replay" re-runs the captured forward from
the same buffers). Only real capture and replay need a GPU (the tests marked `cuda`)."""
from __future__ import annotations

import time

import pytest
import torch

from conftest import make_engine
from loramux.engine.config import EngineConfig
from loramux.engine.cuda_graphs import LoRABuckets, batch_buckets, block_buckets
from loramux.engine.sampling.params import SamplingParams
from loramux.kernels.bgmv import StaticLoRA, bgmv_shrink_expand
from loramux.kernels.torch_ops import lora_expand_reference, lora_shrink_reference
from loramux.model.loader import read_model_config
from loramux.testing import write_peft_adapter

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Two rank buckets: rank 4 on every projection, rank 8 on attention and down_proj.
ADAPTERS = {"a0": (4, ALL), "a1": (4, ALL), "b0": (8, ["q_proj", "v_proj", "o_proj", "down_proj"]),
            "b1": (8, ["q_proj", "v_proj", "o_proj", "down_proj"])}
PROMPTS = [("Hello there", None), ("The capital of France", "a0"), ("One two three", "a1"),
           ("Hello there", "b0"), ("Once upon a time", "b1"), ("The capital of France", "a1"),
           ("Numbers: 1, 2,", None)]


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory, tiny_dir):
    cfg = read_model_config(tiny_dir)[0]
    root = tmp_path_factory.mktemp("graph-adapters")
    return {name: write_peft_adapter(root / name, cfg, rank, targets, seed=i, b_std=1.0)
            for i, (name, (rank, targets)) in enumerate(ADAPTERS.items())}


def lora_engine(tiny_dir, tokenizer, adapter_dirs, **kw):
    engine = make_engine(tiny_dir, tokenizer, max_lora_rank=16, async_adapter_loads=False,
                         adapter_min_residency_s=0.0, step_target_ms=None, **kw)
    for name, path in adapter_dirs.items():
        engine.load_adapter_dir(path, name, allow_base_mismatch=True)
    return engine


def run_all(engine, prompts=PROMPTS, tokens=10):
    for i, (prompt, adapter) in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=tokens, ignore_eos=True),
                           adapter=adapter)
    final = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return [final[f"r{i}"] for i in range(len(prompts))]


def decoding_batch(engine, prompts):
    """Admit `prompts`, step until all of them decode, and schedule (not run) the next step: plain decodes."""
    for i, (prompt, adapter) in enumerate(prompts):
        engine.add_request(f"d{i}", prompt, SamplingParams(max_tokens=50, ignore_eos=True), adapter=adapter)
    while len(engine.scheduler.running) < len(prompts) or any(s.is_prefill for s in engine.scheduler.running):
        engine.step()
    batch = engine.scheduler.schedule(time.monotonic())
    assert not batch.prefills and len(batch.decodes) == len(prompts)
    return batch


def by_seq(step):
    return {seq.request_id: step.logits[row] for seq, row, _ in step.rows}


class RerunGraphs:
    """Stand-in for CudaGraphBackend on CPU: "capture" runs the forward and keeps it with its output; "replay"
    runs it again into that output, reading the same buffers a CUDA graph replay would."""

    def __init__(self, fail: bool = False, corrupt: bool = False):
        self.fail, self.corrupt = fail, corrupt
        self.warm_ups = self.captured = self.replays = self.releases = 0

    def warm_up(self, fn):
        self.warm_ups += 1
        return fn()

    def capture(self, fn):
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        out = fn()
        self.captured += 1
        return (fn, out), out

    def replay(self, graph):
        fn, out = graph
        out.copy_(fn() + (1.0 if self.corrupt else 0.0))
        self.replays += 1

    def release(self):
        self.releases += 1


MODES = ["eager-buffers", "rerun-graphs"]


def use_static(runner, mode, **kw):
    backend = RerunGraphs() if mode == "rerun-graphs" else None
    runner.use_decode_graphs(capture=backend is not None, backend=backend, **kw)
    return backend


# -- buckets -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("max_batch,expected", [
    (1, (1,)), (2, (1, 2)), (4, (1, 2, 4)), (5, (1, 2, 4, 8)), (20, (1, 2, 4, 8, 16, 24)),
    (32, (1, 2, 4, 8, 16, 24, 32)), (10_000, (1, 2, 4) + tuple(range(8, 257, 8))),
])
def test_batch_buckets(max_batch, expected):
    assert batch_buckets(max_batch) == expected


@pytest.mark.parametrize("max_blocks,expected", [(1, (1,)), (8, (8,)), (32, (8, 16, 32)), (40, (8, 16, 32, 40))])
def test_block_buckets(max_blocks, expected):
    assert block_buckets(max_blocks) == expected


def test_lora_buckets_notice_new_replaced_and_dropped_buckets():
    class W:
        def __init__(self):
            self.a, self.scale, self.b = torch.zeros(1), torch.zeros(1), [torch.zeros(1)]

    pool = {("r4", (1, "mlp")): W()}
    buckets = LoRABuckets(lambda bucket, key: pool.get((bucket, key)), [(0, "attn"), (1, "mlp")])
    assert buckets.refresh([]) is False and buckets.generation == 0
    assert buckets.refresh(["r4", "r4"]) is True and buckets.keys == ["r4"] and buckets.generation == 1
    assert buckets.refresh(["r4"]) is False  # the same buffers: the graphs stay
    pool[("r4", (1, "mlp"))] = W()  # resized: new buffers
    assert buckets.refresh([]) is True and buckets.keys == ["r4"] and buckets.generation == 2
    pool[("r4", (1, "mlp"))].a = torch.zeros(1)  # one buffer swapped under the same object
    assert buckets.refresh([]) is True and buckets.generation == 3
    del pool[("r4", (1, "mlp"))]  # dropped
    assert buckets.refresh([]) is True and buckets.keys == [] and buckets.generation == 4


# -- BGMV kernels --------------------------------------------------------------------------------------
BGMV_CASES = [  # tokens, d_in, rank, slice widths, slot map (-1 = no adapter)
    (1, 16, 4, [24], [2]),
    (6, 700, 8, [16, 8, 8], [0, -1, 3, 3, 1, -1]),
    (5, 64, 16, [33, 40], [-1, -1, -1, -1, -1]),
    (9, 96, 12, [20], [1, 0, 1, 2, 3, 0, 2, 1, 3]),  # a rank that is no power of two
]


@pytest.mark.parametrize("impl,split_k", [("torch", None), ("triton", 1), ("triton", 3)])
@pytest.mark.parametrize("num_tokens,d_in,rank,widths,slot_map", BGMV_CASES)
def test_bgmv_matches_float64_reference(impl, split_k, num_tokens, d_in, rank, widths, slot_map, monkeypatch):
    if split_k is not None:
        from loramux.kernels import triton_ops

        monkeypatch.setattr(triton_ops, "bgmv_split_k", lambda *args: split_k)
    g = torch.Generator().manual_seed(num_tokens * 100 + rank)
    n_slots, n = 4, len(widths)
    # Strided layouts, as the device pool keeps them on CPU: A [slots, rows, d_in] seen through a transpose or
    # a permute, B stored [slots, R, d_out] and handed over transposed.
    if num_tokens % 2:
        a = (torch.randn(n_slots, d_in, n * rank, generator=g) / d_in**0.5).transpose(1, 2)
    else:
        a = (torch.randn(d_in, n_slots, n * rank, generator=g) / d_in**0.5).permute(1, 2, 0)
    bs = [torch.randn(n_slots, rank, w, generator=g).transpose(1, 2) for w in widths]
    offsets = [3 + sum(widths[:i]) for i in range(n)]
    scale = torch.tensor([0.5, 2.0, 1.0, 0.25])
    x = torch.randn(num_tokens, d_in, generator=g)
    y = torch.randn(num_tokens, 3 + sum(widths) + 5, generator=g)
    slots = torch.tensor(slot_map)
    expected = y.double().clone()
    for i, (b, offset) in enumerate(zip(bs, offsets)):
        v = lora_shrink_reference(x, a[:, i * rank:(i + 1) * rank], slots)
        expected = lora_expand_reference(expected, v, b, scale, slots, offset)
    before = y.clone()
    bgmv_shrink_expand(y, x, a, bs, offsets, scale, slots, impl=impl)
    torch.testing.assert_close(y.double(), expected, atol=1e-4, rtol=1e-4)
    assert torch.equal(y[slots < 0], before[slots < 0]), "rows without an adapter must be left untouched"
    assert torch.equal(y[:, :3], before[:, :3]) and torch.equal(y[:, -5:], before[:, -5:])


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_static_lora_applies_what_the_wrapper_applies(tiny_dir, tokenizer, adapter_dirs, impl):
    """StaticLoRA with per-bucket slot indices == LoRAWrapper with segments, on the pool's real buffers."""
    engine = lora_engine(tiny_dir, tokenizer, adapter_dirs)
    run_all(engine, PROMPTS[1:5], tokens=1)  # make every adapter resident
    loc = {name: engine.adapters.location(engine.adapters.by_name[name]) for name in ADAPTERS}
    rows = [loc["a0"], None, loc["b1"], loc["a1"], loc["b0"], loc["a0"], None]
    wrapper = engine.pool.wrapper
    static = StaticLoRA(wrapper.weights_of, impl)
    buckets = list(dict.fromkeys(r[0] for r in rows if r is not None))
    static.slots = [(bk, torch.tensor([r[1] if r is not None and r[0] == bk else -1 for r in rows])) for bk in buckets]
    g = torch.Generator().manual_seed(0)
    for key in [(0, "self_attn.qkv_proj"), (1, "mlp.gate_up_proj")]:
        module = engine.model.get_submodule(f"layers.{key[0]}.{key[1]}")
        x = torch.randn(len(rows), module.in_features, generator=g)
        y = torch.randn(len(rows), module.out_features, generator=g)
        expected = y.clone()
        wrapper.set_batch(rows)
        wrapper.apply(expected, x, key)
        assert not torch.equal(expected, y)
        static.apply(y, x, key)
        torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)


# -- the static path in the engine (eager on CPU) ------------------------------------------------------
@pytest.fixture(scope="module")
def eager_outputs(tiny_dir, tokenizer, adapter_dirs):
    return run_all(lora_engine(tiny_dir, tokenizer, adapter_dirs))


@pytest.mark.parametrize("mode", MODES)
def test_static_decode_gives_the_eager_tokens_with_mixed_adapters(tiny_dir, tokenizer, adapter_dirs,
                                                                  eager_outputs, mode):
    eager = eager_outputs
    engine = lora_engine(tiny_dir, tokenizer, adapter_dirs)
    backend = use_static(engine.runner, mode)
    static = run_all(engine)
    graphs = engine.runner.graphs
    assert graphs.steps >= 8 and len(graphs.lora.keys) == 2  # both rank buckets in the fixed-shape step
    assert {k[0] for k in graphs.entries} <= set(graphs.batch_sizes) and not graphs.disabled
    if backend is not None:  # each shape captured once (again after a new bucket), replayed every step
        assert backend.captured == graphs.captures >= len(graphs.entries) >= 1
        assert backend.replays == graphs.steps and graphs.steps > graphs.captures
    for e, s in zip(eager, static):
        assert list(s.token_ids) == list(e.token_ids)
        assert s.logprobs == pytest.approx(e.logprobs, abs=1e-4)
    assert list(eager[0].token_ids) != list(eager[3].token_ids), "the adapters must change the output"


@pytest.mark.parametrize("mode", MODES)
def test_static_step_logits_equal_eager_logits(tiny_dir, tokenizer, adapter_dirs, mode):
    engine = lora_engine(tiny_dir, tokenizer, adapter_dirs)
    batch = decoding_batch(engine, PROMPTS[:6])  # 6 rows -> the batch-8 shape, 2 padding rows
    eager = by_seq(engine.runner.run(batch))
    use_static(engine.runner, mode)
    for _ in range(2):  # (capture and) replay
        static = by_seq(engine.runner.run(batch))
        assert static.keys() == eager.keys()
        for rid in eager:
            torch.testing.assert_close(static[rid], eager[rid], atol=1e-4, rtol=1e-4)
    assert engine.runner.graphs.steps == 2 and list(engine.runner.graphs.entries) == [(8, 8)]


def test_padding_rows_write_only_the_scratch_block(tiny_dir, tokenizer, adapter_dirs):
    engine = lora_engine(tiny_dir, tokenizer, adapter_dirs)
    batch = decoding_batch(engine, PROMPTS[:3])  # 3 rows -> the batch-4 shape
    runner = engine.runner
    runner.use_decode_graphs(capture=False)
    k_before, v_before = runner.kv.k.clone(), runner.kv.v.clone()
    runner.run(batch)
    bs = runner.block_size
    changed = set()
    for after, before in ((runner.kv.k, k_before), (runner.kv.v, v_before)):
        diff = (after != before).flatten(start_dim=3).any(-1).any(0)  # [blocks, block_size]
        changed |= {int(i) for i in diff.flatten().nonzero().flatten()}
    real = {s.block_table[s.num_computed_tokens // bs] * bs + s.num_computed_tokens % bs for s in batch.decodes}
    scratch = set(range(runner.scratch_block * bs, (runner.scratch_block + 1) * bs))
    assert real <= changed and changed <= real | scratch and changed & scratch
    assert runner.scratch_block == engine.block_manager.num_blocks  # never handed out


def test_steps_the_graphs_cannot_take_run_eagerly(tiny_dir, tokenizer, adapter_dirs):
    from loramux.engine.scheduling.scheduler import ScheduledBatch

    engine = lora_engine(tiny_dir, tokenizer, adapter_dirs)
    runner = engine.runner
    runner.use_decode_graphs(capture=False, max_batch=2)
    batch = decoding_batch(engine, [(list(range(5, 25)), None), PROMPTS[1], PROMPTS[2]])
    assert runner.graphs.steps == 0  # one prefill step, then 3 decodes > the largest bucket (2)
    assert not runner.graphs.accepts(batch)
    two = ScheduledBatch(decodes=batch.decodes[:2])
    assert runner.graphs.accepts(two)
    batch.decodes[0].draft_token_ids = [5]  # a speculative verification
    assert not runner.graphs.accepts(two)
    batch.decodes[0].draft_token_ids = []
    runner.max_model_len = 16  # the first context (20 prompt tokens) is wider than the widest block table
    runner.use_decode_graphs(capture=False)
    assert runner.run(two).logits.shape[0] == 2
    assert runner.graphs.steps == 0  # it fell back to the eager path
    assert runner.run(ScheduledBatch(decodes=batch.decodes[1:])).logits.shape[0] == 2
    assert runner.graphs.steps == 1


@pytest.mark.parametrize("mode", MODES)
def test_a_resized_bucket_drops_the_graphs_and_stays_correct(tiny_dir, tokenizer, adapter_dirs, mode):
    engine = lora_engine(tiny_dir, tokenizer, adapter_dirs)
    batch = decoding_batch(engine, PROMPTS[1:5])
    runner = engine.runner
    backend = use_static(runner, mode)
    first = by_seq(runner.run(batch))
    generation = runner.graphs.lora.generation
    key = runner.locate_adapter(engine.adapters.by_name["a0"])[0]
    capacity = engine.pool.capacity(key)
    old = engine.pool.wrapper.weights_of(key, (0, "self_attn.qkv_proj"))
    engine.pool.resize(key, capacity + 1, list(range(capacity)))  # new buffers, same slots
    old.a.zero_()  # a real graph left on the old addresses would read these zeros (see the cuda test)
    again = by_seq(runner.run(batch))
    assert runner.graphs.lora.generation == generation + 1
    for rid in first:
        torch.testing.assert_close(again[rid], first[rid])
    if backend is not None:
        assert backend.releases == 1 and backend.captured == runner.graphs.captures == 2


def test_a_failed_capture_falls_back_to_eager_steps(tiny_dir, tokenizer, adapter_dirs, caplog):
    engine = lora_engine(tiny_dir, tokenizer, adapter_dirs)
    batch = decoding_batch(engine, PROMPTS[:4])
    eager = by_seq(engine.runner.run(batch))
    for backend in (RerunGraphs(fail=True), RerunGraphs(corrupt=True)):
        engine.runner.use_decode_graphs(capture=True, backend=backend)
        graphs = engine.runner.graphs
        for _ in range(2):
            step = by_seq(engine.runner.run(batch))  # the warm-up's logits, then the eager path's
            for rid in eager:
                torch.testing.assert_close(step[rid], eager[rid], atol=1e-4, rtol=1e-4)
        assert graphs.disabled and graphs.steps == 1 and graphs.captures == 0 and not graphs.entries
        assert not graphs.accepts(batch)
    assert "decode runs eagerly from now on" in caplog.text and "differ from the eager run" in caplog.text


def test_cuda_graphs_knob(tiny_dir, tokenizer, monkeypatch):
    from loramux.settings import Settings

    assert EngineConfig().cuda_graphs is True and Settings().cuda_graphs is True
    monkeypatch.setenv("LORAMUX_CUDA_GRAPHS", "false")
    assert Settings().cuda_graphs is False
    engine = make_engine(tiny_dir, tokenizer, cuda_graphs=True)
    assert engine.runner.graphs is None  # CUDA only
    with pytest.raises(ValueError, match="CUDA"):
        engine.runner.use_decode_graphs(capture=True)


# -- capture and replay (CUDA only) --------------------------------------------------------------------
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs a CUDA device")


def cuda_engine(tiny_dir, tokenizer, adapter_dirs, graphs: bool):
    from loramux.engine.engine import LLMEngine
    from loramux.model.loader import build_model, end_of_turn_ids

    model, cfg = build_model(tiny_dir, torch.float32, torch.device("cuda"))
    config = EngineConfig(num_blocks=256, block_size=16, max_num_seqs=32, max_num_batched_tokens=256,
                          max_model_len=512, max_lora_rank=16, async_adapter_loads=False,
                          adapter_min_residency_s=0.0, step_target_ms=None, cuda_graphs=graphs)
    engine = LLMEngine(model, tokenizer, config, end_of_turn_ids(tokenizer, cfg, tiny_dir), device="cuda")
    for name, path in adapter_dirs.items():
        engine.load_adapter_dir(path, name, allow_base_mismatch=True)
    return engine


@cuda
def test_cuda_graph_replay_gives_the_eager_tokens(tiny_dir, tokenizer, adapter_dirs):
    eager = run_all(cuda_engine(tiny_dir, tokenizer, adapter_dirs, graphs=False))
    engine = cuda_engine(tiny_dir, tokenizer, adapter_dirs, graphs=True)
    graphed = run_all(engine)
    graphs = engine.runner.graphs
    assert not graphs.disabled and graphs.captures >= 1 and graphs.steps > graphs.captures
    for e, s in zip(eager, graphed):
        assert list(s.token_ids) == list(e.token_ids)
        assert s.logprobs == pytest.approx(e.logprobs, abs=1e-3)


@cuda
def test_cuda_graph_step_logits_equal_eager_and_survive_a_resize(tiny_dir, tokenizer, adapter_dirs):
    engine = cuda_engine(tiny_dir, tokenizer, adapter_dirs, graphs=False)
    batch = decoding_batch(engine, PROMPTS[:5])
    runner = engine.runner
    eager = by_seq(runner.run(batch))
    runner.use_decode_graphs(capture=True)
    for _ in range(2):  # capture, then replay
        graphed = by_seq(runner.run(batch))
        for rid in eager:
            torch.testing.assert_close(graphed[rid], eager[rid], atol=1e-3, rtol=1e-3)
    assert runner.graphs.captures == 1 and not runner.graphs.disabled
    key = runner.locate_adapter(engine.adapters.by_name["b0"])[0]
    capacity = engine.pool.capacity(key)
    old = engine.pool.wrapper.weights_of(key, (0, "self_attn.qkv_proj"))
    engine.pool.resize(key, capacity + 1, list(range(capacity)))
    old.a.zero_()  # a stale graph would still read these
    graphed = by_seq(runner.run(batch))  # stale graphs dropped, captured again on the new buffers
    assert runner.graphs.captures == 2
    for rid in eager:
        torch.testing.assert_close(graphed[rid], eager[rid], atol=1e-3, rtol=1e-3)
