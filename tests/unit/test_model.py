"""The project's Llama-family model against HF transformers on small random checkpoints."""
from __future__ import annotations

import pytest
import torch

from loramux.engine.model_runner import ModelRunner
from loramux.engine.sampling.params import SamplingParams
from loramux.engine.scheduling.block_manager import BlockManager
from loramux.engine.scheduling.scheduler import Scheduler
from loramux.engine.sequence import Sequence
from loramux.model.config import ModelConfig, UnsupportedModelError
from loramux.model.loader import build_model
from loramux.testing import save_tiny_hf_model

VOCAB = 300

FAMILIES = {
    "llama-untied": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama-mha": ("llama", {"num_key_value_heads": 4}),
    "llama3-rope-scaling": ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                       "high_freq_factor": 4.0,
                                                       "original_max_position_embeddings": 16}}),
    "linear-rope-scaling": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "mistral": ("mistral", {"sliding_window": None}),
    "qwen2-bias": ("qwen2", {}),
    "head-dim-override": ("llama", {"head_dim": 32}),
    # The sliding-window cases run prompts longer than their window of 8.
    "mistral-window": ("mistral", {"sliding_window": 8}),
    "qwen2-window-top-layer": ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}),
    "qwen3": ("qwen3", {"head_dim": 32}),
    "gemma2": ("gemma2", {"head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 8,
                          "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0}),
    "gemma3": ("gemma3_text", {"head_dim": 16, "num_hidden_layers": 3, "sliding_window": 8,
                               "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
                               "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                   "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                      "rope_theta": 1000000.0}}}),
    "phi3": ("phi3", {"pad_token_id": 0}),
    "phi3-longrope-partial": ("phi3", {"pad_token_id": 0, "original_max_position_embeddings": 16,
                                       "partial_rotary_factor": 0.75,
                                       "rope_scaling": {"rope_type": "longrope",
                                                        "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                                                        "long_factor": [1.5, 2.0, 3.0, 4.0, 6.0, 8.0]}}),
    "llama-yarn": ("llama", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                              "original_max_position_embeddings": 16}}),
    "qwen3_moe": ("qwen3_moe", {"head_dim": 16, "moe_intermediate_size": 32, "num_experts": 8,
                                "num_experts_per_tok": 2, "norm_topk_prob": True}),
    "qwen2_moe-shared-dense-layer": ("qwen2_moe", {"moe_intermediate_size": 32, "num_experts": 8,
                                                   "num_experts_per_tok": 2, "shared_expert_intermediate_size": 48,
                                                   "num_hidden_layers": 3, "mlp_only_layers": [1]}),
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "olmoe-clip": ("olmoe", {"num_experts": 8, "num_experts_per_tok": 3, "clip_qkv": 2.0}),
    "gpt_oss-window": ("gpt_oss", {"head_dim": 16, "num_local_experts": 8, "num_experts_per_tok": 2,
                                   "sliding_window": 8, "intermediate_size": 48}),
}


def run_chunks(model, ids: list[int], chunk: int, block_size: int = 4):
    """Logits for every position of `ids`, computed through the paged cache in chunks of `chunk`."""
    blocks = BlockManager(64, block_size)
    scheduler = Scheduler(blocks, max_num_seqs=4, max_num_batched_tokens=chunk)
    runner = ModelRunner(model, 64, block_size, torch.float32, torch.device("cpu"))
    seq = Sequence("r", list(ids), SamplingParams(max_tokens=1))
    scheduler.add(seq)
    logits = []
    while seq.num_computed_tokens < len(ids):
        batch = scheduler.schedule()
        input_ids, positions, meta, _, _ = runner.prepare(batch)
        logits.append(model.compute_logits(model(input_ids, positions, runner.kv, meta)))
        scheduler.complete(batch)
    return torch.cat(logits), seq, scheduler, runner


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_match_hf(tmp_path, family):
    model_type, overrides = FAMILIES[family]
    hf = save_tiny_hf_model(tmp_path, VOCAB, model_type, **overrides)
    model, cfg = build_model(tmp_path, torch.float32, torch.device("cpu"))
    assert cfg.model_type == model_type
    ids = torch.randint(3, VOCAB, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    for chunk in (37, 5):  # one fresh prefill; chunks that read earlier tokens from the cache across blocks
        ours, *_ = run_chunks(model, ids, chunk)
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def test_decode_step_matches_hf(tmp_path):
    hf = save_tiny_hf_model(tmp_path, VOCAB, "llama")
    model, _ = build_model(tmp_path, torch.float32, torch.device("cpu"))
    ids = list(range(10, 30))
    _, seq, scheduler, runner = run_chunks(model, ids, 8)
    for next_token in (5, 77, 123):
        seq.output_token_ids.append(next_token)
        batch = scheduler.schedule()
        assert batch.decodes == [seq]
        logits = runner.run(batch).logits
        scheduler.complete(batch)
        with torch.no_grad():
            ref = hf(torch.tensor([seq.token_ids])).logits[0, -1]
        torch.testing.assert_close(logits[0], ref, atol=1e-4, rtol=1e-4)


def test_bfloat16_model_runs_close_to_float32(tmp_path):
    save_tiny_hf_model(tmp_path, VOCAB, "llama")
    ids = list(range(3, 40))
    ref, *_ = run_chunks(build_model(tmp_path, torch.float32, torch.device("cpu"))[0], ids, 64)
    model16, _ = build_model(tmp_path, torch.bfloat16, torch.device("cpu"))
    blocks = BlockManager(64, 4)
    runner = ModelRunner(model16, 64, 4, torch.bfloat16, torch.device("cpu"))
    scheduler = Scheduler(blocks, 4, 64)
    scheduler.add(Sequence("r", ids, SamplingParams(max_tokens=1)))
    logits = runner.run(scheduler.schedule()).logits
    assert logits.dtype == torch.float32
    assert (logits[0] - ref[-1]).abs().max() < 0.1


def test_unsupported_architectures_are_refused_clearly():
    base = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
            "num_attention_heads": 2}
    with pytest.raises(UnsupportedModelError) as refused:
        ModelConfig.from_hf({**base, "model_type": "gpt2"})
    assert str(refused.value) == ("model_type 'gpt2' is not supported; supported: llama, mistral, qwen2, qwen3, "
                                  "gemma2, gemma3_text, phi3, qwen3_moe, qwen2_moe, mixtral, olmoe, gpt_oss, "
                                  "qwen3_next, qwen3_5_text, gemma3, qwen3_5")
    with pytest.raises(UnsupportedModelError, match="text_config"):  # a multimodal checkpoint: its language model
        ModelConfig.from_hf({**base, "model_type": "gemma3"})
    with pytest.raises(UnsupportedModelError, match="relu2"):
        ModelConfig.from_hf({**base, "model_type": "llama", "hidden_act": "relu2"})
    with pytest.raises(UnsupportedModelError, match="dynamic"):
        ModelConfig.from_hf({**base, "model_type": "llama", "rope_scaling": {"rope_type": "dynamic", "factor": 4}})


def test_missing_tensor_is_reported(tmp_path):
    from safetensors.torch import load_file, save_file

    save_tiny_hf_model(tmp_path, VOCAB, "llama")
    state = load_file(tmp_path / "model.safetensors")
    state.pop("model.layers.1.self_attn.k_proj.weight")
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="layers.1.self_attn.qkv_proj.weight"):
        build_model(tmp_path, torch.float32, torch.device("cpu"))
