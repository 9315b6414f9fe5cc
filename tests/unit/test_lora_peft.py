"""Mixed-adapter batches on SmolLM2 against PEFT (each adapter run alone on the same base): ranks 4 to 128
in one batch, each held and computed at its own rank."""
from __future__ import annotations

import pytest
import torch

from loramux.engine.config import EngineConfig
from loramux.engine.engine import LLMEngine
from loramux.engine.sampling.params import SamplingParams
from loramux.model.loader import build_model, end_of_turn_ids
from loramux.testing import write_peft_adapter

pytestmark = pytest.mark.real_model

ADAPTERS = {  # name: (rank, targets, rslora)
    "r4-attn": (4, ["q_proj", "v_proj"], False),
    "r8-mlp": (8, ["gate_proj", "up_proj", "down_proj"], False),
    "r16-all": (16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], True),
    "r32-gu": (32, ["gate_proj", "up_proj"], False),
    "r64-ko": (64, ["k_proj", "o_proj", "down_proj"], False),
    "r128-all": (128, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], False),
}
QUESTIONS = ["What is the capital of France?", "Write a haiku about snow.", "Name three colours."]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory, smol_dir):
    from loramux.model.loader import read_model_config

    cfg, _ = read_model_config(smol_dir)
    root = tmp_path_factory.mktemp("adapters")
    return {name: write_peft_adapter(root / name, cfg, rank, targets, seed=i, use_rslora=rslora)
            for i, (name, (rank, targets, rslora)) in enumerate(ADAPTERS.items())}


@pytest.fixture(scope="module")
def peft_outputs(smol_dir, adapter_dirs, tokenizer):
    """Greedy tokens from PEFT for each (question, adapter or None), one request at a time."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(smol_dir, dtype=torch.float32).eval()
    names = list(adapter_dirs)
    model = PeftModel.from_pretrained(base, adapter_dirs[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(adapter_dirs[name], adapter_name=name)
    model.eval()
    results = {}
    for q_index, question in enumerate(QUESTIONS):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                            tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        for name in [None] + names:
            inputs = torch.tensor([ids])
            with torch.inference_mode():
                if name is None:
                    with model.disable_adapter():
                        out = model.generate(input_ids=inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
                else:
                    model.set_adapter(name)
                    out = model.generate(input_ids=inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
            results[(q_index, name)] = out[0, len(ids):].tolist()
    return results


def test_mixed_batch_equals_peft_per_adapter(smol_dir, tokenizer, adapter_dirs, peft_outputs):
    model, cfg = build_model(smol_dir, torch.float32, torch.device("cpu"))
    engine = LLMEngine(model, tokenizer, EngineConfig(num_blocks=400, max_num_seqs=32, max_num_batched_tokens=256,
                                                      max_lora_rank=128),
                       end_of_turn_ids(tokenizer, cfg, smol_dir))
    for name, path in adapter_dirs.items():
        engine.load_adapter_dir(path, name)
    params = SamplingParams(max_tokens=NEW_TOKENS)
    names = [None] + list(adapter_dirs)
    expected = {}
    for q_index, question in enumerate(QUESTIONS):
        ids = engine.encode_chat([{"role": "user", "content": question}])
        for name in names:
            rid = f"{q_index}/{name}"
            engine.add_request(rid, ids, params, adapter=name)
            expected[rid] = peft_outputs[(q_index, name)]
    finished = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.token_ids
    assert finished == expected
    # The adapters matter: each changes the output of at least one question.
    for name in adapter_dirs:
        assert any(peft_outputs[(q, name)] != peft_outputs[(q, None)] for q in range(len(QUESTIONS))), name
    stats = engine.stats()
    assert stats["adapter_slots_pinned"] == 0 and stats["kv_blocks_used"] == 0
    assert sorted(key.rank for key in engine.pool.buckets) == sorted(r for r, _, _ in ADAPTERS.values())
