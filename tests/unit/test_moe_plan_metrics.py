"""Mixture-of-experts bases in operations: tokens per expert (engine stats and /metrics), `loramux plan`'s
experts, parameters and expert-LoRA bytes (checked by hand for Qwen3-30B-A3B and against the device pool), no
CUDA-graph decode path for routed experts, and the refusal of MXFP4-quantized gpt-oss checkpoints."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from conftest import make_engine, run_to_completion
from loramux.cli import main
from loramux.engine.calibration import calibrate_step_cost
from loramux.engine.sampling.params import SamplingParams
from loramux.model.config import ModelConfig, UnsupportedModelError
from loramux.model.llama import MergedLinear
from loramux.model.loader import build_model
from loramux.model.moe import MoEBlock, route
from loramux.plan import expert_lora_bytes, fmt_bytes, plan_memory, weight_bytes
from loramux.server.serving.metrics import ServerMetrics
from loramux.testing import save_tiny_hf_model

VOCAB = 300  # a small vocabulary: tiny-model outputs repeat tokens, so prompt lookup drafts and verifies
QWEN3_30B = Path(__file__).parents[1] / "data" / "qwen3-30b-a3b-config.json"
TINY = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "head_dim": 16}
SERIES = "loramux_moe_expert_tokens"


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny-qwen3-moe")
    save_tiny_hf_model(path, VOCAB, "qwen3_moe", weight_scale=4.0, **TINY)
    return path


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_hf_model(path, VOCAB)
    return path


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() * 2 for n in (7, 12, 20)]


def routing_reference(model) -> tuple[dict[int, torch.Tensor], list[int]]:
    """Hooks that count, independently of the engine's counter, each sparse layer's (token, expert) pairs from
    its router's logits, and the rows of every forward."""
    pairs: dict[int, torch.Tensor] = {}
    rows: list[int] = []
    for block in model.modules():
        if isinstance(block, MoEBlock):
            pairs[block.layer] = torch.zeros(block.moe.num_experts, dtype=torch.long)

            def hook(module, args, logits, block=block):
                _, ids = route(logits, block.moe)
                pairs[block.layer] += torch.bincount(ids.reshape(-1), minlength=block.moe.num_experts)

            block.router.register_forward_hook(hook)
    model.register_forward_hook(lambda module, args, out: rows.append(args[0].shape[0]))
    return pairs, rows


def scrape(stats: dict) -> dict[tuple[str, str], float]:
    metrics = ServerMetrics()
    metrics.set_state_source(lambda: stats)
    body, _ = metrics.render()
    return {(s.labels["layer"], s.labels["expert"]): s.value
            for family in text_string_to_metric_families(body.decode()) for s in family.samples
            if s.name == SERIES + "_total"}


def test_tokens_per_expert_count_every_routing_pair(moe_dir, tokenizer):
    """Prefill chunks, decodes and speculative verification: the counter holds exactly the (token, expert) pairs
    the routers chose, top-k per computed token; stats() and /metrics expose them per layer and expert."""
    engine = make_engine(moe_dir, tokenizer, block_size=4, max_num_seqs=8, max_num_batched_tokens=16,
                         speculative_tokens=3, speculative_max_batch=8, prefix_caching=False)
    pairs, rows = routing_reference(engine.model)
    outs = run_to_completion(engine, [(ids, SamplingParams(max_tokens=12, ignore_eos=True), None)
                                      for ids in prompts()])
    assert all(len(out.token_ids) == 12 for out in outs)
    stats = engine.stats()
    assert stats["spec_proposed_tokens"] > 0, "prompt lookup should have drafted, so verification ran"
    counted = stats["moe_expert_tokens"]
    assert len(counted) == 2 and sorted(pairs) == [0, 1]
    for layer, reference in pairs.items():
        assert counted[layer] == reference.tolist(), layer
        assert sum(counted[layer]) == 2 * sum(rows)  # top-2 of every token row of every forward
    assert len(rows) > len(outs[0].token_ids)  # several steps, prefill chunked (16 tokens a step)
    exposed = scrape(stats)
    assert exposed == {(str(layer), str(e)): float(n) for layer, row in enumerate(counted) for e, n in enumerate(row)}
    assert len(exposed) == 2 * 8


def test_dense_models_have_no_expert_series(dense_dir, tokenizer):
    engine = make_engine(dense_dir, tokenizer)
    run_to_completion(engine, [(prompts()[0], SamplingParams(max_tokens=3, ignore_eos=True), None)])
    stats = engine.stats()
    assert stats["moe_expert_tokens"] == [] and engine.counters.expert_tokens is None
    assert scrape(stats) == {}
    metrics = ServerMetrics()
    metrics.set_state_source(lambda: stats)
    assert SERIES not in metrics.render()[0].decode()


def test_calibration_is_not_counted(moe_dir, tokenizer):
    engine = make_engine(moe_dir, tokenizer)
    assert calibrate_step_cost(engine, rounds=1) > 0
    assert engine.stats()["moe_expert_tokens"] == [[0] * 8, [0] * 8]
    run_to_completion(engine, [(prompts()[0], SamplingParams(max_tokens=2, ignore_eos=True), None)])
    assert sum(engine.stats()["moe_expert_tokens"][0]) == 2 * (len(prompts()[0]) + 1)  # prompt + 1 decode, top-2


def test_moe_models_never_take_the_cuda_graph_path(moe_dir, tokenizer, caplog):
    """Routing is data-dependent (host-side counts size the grouped matmuls): use_decode_graphs is refused,
    said once at info level, and decode steps run eagerly with the same tokens."""
    eager = make_engine(moe_dir, tokenizer)
    expected = [out.token_ids for out in run_to_completion(
        eager, [(ids, SamplingParams(max_tokens=6, ignore_eos=True), None) for ids in prompts()])]
    engine = make_engine(moe_dir, tokenizer)
    with caplog.at_level(logging.INFO, logger="loramux.engine.model_runner"):
        assert engine.runner.use_decode_graphs(capture=False) is False
        assert engine.runner.use_decode_graphs(capture=True, backend=object()) is False
    refusals = [r for r in caplog.records if "without CUDA graphs" in r.getMessage()]
    assert len(refusals) == 1 and refusals[0].levelno == logging.INFO
    assert "mixture-of-experts routing is data-dependent" in refusals[0].getMessage()
    assert engine.runner.graphs is None and engine.runner.graphs_refused
    got = [out.token_ids for out in run_to_completion(
        engine, [(ids, SamplingParams(max_tokens=6, ignore_eos=True), None) for ids in prompts()])]
    assert got == expected


def test_dense_models_still_take_it(dense_dir, tokenizer):
    engine = make_engine(dense_dir, tokenizer)
    assert engine.runner.use_decode_graphs(capture=False) is True and engine.runner.graphs is not None


# -- loramux plan ---------------------------------------------------------------------------------------------
def qwen3_30b_by_hand() -> dict[str, int]:
    """Qwen3-30B-A3B from its published shapes: hidden 2048, 48 layers, 128 experts (top-8) of width 768,
    32 heads of 128, 4 KV heads, vocabulary 151936, untied."""
    h, layers, experts, k, width, vocab = 2048, 48, 128, 8, 768, 151936
    q, kv = 32 * 128, 4 * 128
    attention = h * q + 2 * h * kv + q * h + 2 * h + 2 * 128  # q, k, v, o; two norms and the q/k head norms
    router, expert = experts * h, 3 * h * width
    outside = 2 * vocab * h + h  # embedding, LM head, final norm
    return {"total": outside + layers * (attention + router + experts * expert),
            "active": outside + layers * (attention + router + k * expert),
            # rank 1 in bf16: per sparse layer and expert, gate_up (2048 -> 1536) and down (768 -> 2048)
            "expert_lora_rank1_bf16": layers * experts * ((h + 2 * width) + (width + h)) * 2,
            "expert_scales": layers * experts * 2 * 4,
            "attention_lora_rank1_bf16": layers * ((h + q) + 2 * (h + kv) + (q + h)) * 2}


def test_qwen3_30b_a3b_plan_numbers(capsys):
    cfg = ModelConfig.from_hf(json.loads(QWEN3_30B.read_text()))
    hand = qwen3_30b_by_hand()
    with capsys.disabled():  # shown with -s
        print(f"\nQwen3-30B-A3B: {hand['total']:,} parameters, {hand['active']:,} active; rank-16 bf16 expert "
              f"LoRA {16 * hand['expert_lora_rank1_bf16'] + hand['expert_scales']:,} bytes per adapter")
    assert cfg.num_parameters() == hand["total"] == 30_532_122_624  # "30.5B" as published
    assert cfg.active_parameters() == hand["active"] == 3_353_032_704  # "3.3B activated"
    plan = plan_memory(cfg, 2, context_len=4096, batch_size=16, adapter_pool=8 * 1024**3, adapter_rank=16)
    assert plan.weights == hand["total"] * 2  # every expert
    assert plan.kv_per_token == 2 * 48 * 4 * 128 * 2
    assert plan.adapter_bytes == 16 * hand["attention_lora_rank1_bf16"] == 26_738_688  # no dense MLP to adapt
    expert = 16 * hand["expert_lora_rank1_bf16"] + hand["expert_scales"]
    assert plan.expert_lora_bytes == expert == 1_258_340_352
    assert plan.adapters_fit == 8 * 1024**3 // 26_738_688 == 321
    plan.expert_lora = True
    assert plan.slot_bytes == 26_738_688 + expert and plan.adapters_fit == 6

    capsys.readouterr()
    assert main(["plan", "--config", str(QWEN3_30B), "--dtype", "bf16", "--adapter-pool", "8GiB",
                 "--expert-lora", "--memory", "80GiB"]) == 0
    out = capsys.readouterr().out
    assert "128 routed experts of width 768, top-8, in 48 of 48 layers: 30.53B parameters, 3.35B active" in out
    assert f"6 adapters of rank 16 on attention and the routed experts at {fmt_bytes(26_738_688 + expert)}" in out
    assert f"adds {fmt_bytes(expert)} to an adapter of rank 16" in out and "fits in" in out
    assert main(["plan", "--config", str(QWEN3_30B), "--dtype", "bf16", "--adapter-pool", "8GiB"]) == 0
    assert "321 adapters of rank 16 on attention at" in capsys.readouterr().out
    assert main(["plan", "--config", str(Path(__file__).parents[1] / "data" / "llama2-7b-config.json"),
                 "--expert-lora"]) == 2
    assert "--expert-lora needs a mixture-of-experts base" in capsys.readouterr().err


MOE_CONFIGS = {  # a dense layer among sparse ones with a shared expert; expert biases; every layer sparse
    "qwen2_moe": ("qwen2_moe", {"moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2,
                                "shared_expert_intermediate_size": 48, "num_hidden_layers": 3,
                                "mlp_only_layers": [1]}),
    "gpt_oss": ("gpt_oss", {"head_dim": 16, "num_local_experts": 8, "num_experts_per_tok": 2,
                            "intermediate_size": 48}),
    "qwen3_moe": ("qwen3_moe", TINY),
}


@pytest.mark.parametrize("family", sorted(MOE_CONFIGS))
def test_plan_agrees_with_the_device_pool_and_the_int8_model(family, tmp_path):
    """Expert-LoRA bytes as the pool's expert slots count them, a whole slot as the pool sizes it, and int8
    weights (experts left in the model's dtype) as the loaded model holds them."""
    from loramux.adapters.residency.device_pool import BucketKey, DevicePool
    from loramux.adapters.residency.expert_slots import slot_bytes
    from loramux.model.llama import LORA_MODULES

    model_type, overrides = MOE_CONFIGS[family]
    save_tiny_hf_model(tmp_path, VOCAB, model_type, **overrides)
    model, cfg = build_model(tmp_path, torch.float32, torch.device("cpu"))
    for rank in (1, 8, 16):
        for element in (2, 4):
            key = (("gate_up", rank), ("down", rank))
            assert expert_lora_bytes(cfg, rank, element) == slot_bytes(key, cfg, element), (rank, element)
    pool = DevicePool(model, 1 << 20, torch.float32, "cpu", async_loads=False)
    paths = tuple(path for path in LORA_MODULES if path in pool.shapes and path != "mlp.router")
    plan = plan_memory(cfg, 4, 64, 1, 0, 8)
    assert pool.slot_bytes(BucketKey(8, paths)) == plan.adapter_bytes
    plan.expert_lora = True
    assert pool.slot_bytes(BucketKey(8, paths, experts=(("gate_up", 8), ("down", 8)))) == plan.slot_bytes

    quantized, cfg = build_model(tmp_path, torch.float32, torch.device("cpu"), quantization="int8")
    int8 = sum(m.int8.nbytes for m in quantized.modules() if isinstance(m, MergedLinear))
    floats = sum(p.numel() * 4 for p in quantized.parameters())  # embedding, norms, biases, routed experts
    assert weight_bytes(cfg, 4, "int8") == int8 + floats


def gpt_oss_config(**extra) -> dict:
    return {"model_type": "gpt_oss", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 48,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "num_local_experts": 8, "num_experts_per_tok": 2, **extra}


def test_mxfp4_gpt_oss_checkpoints_are_refused(tmp_path, capsys):
    mxfp4 = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "lm_head"]}
    with pytest.raises(UnsupportedModelError, match="MXFP4") as refused:
        ModelConfig.from_hf(gpt_oss_config(quantization_config=mxfp4))
    assert "'mxfp4'" in str(refused.value) and "bfloat16" in str(refused.value)
    assert ModelConfig.from_hf(gpt_oss_config()).moe is not None  # the dequantized checkpoint is served
    path = tmp_path / "config.json"
    path.write_text(json.dumps(gpt_oss_config(quantization_config=mxfp4)))
    assert main(["plan", "--config", str(path)]) == 2
    assert "MXFP4" in capsys.readouterr().err
