"""The engine on the embedded SmolLM2-135M-Instruct against HF transformers (the reference)."""
from __future__ import annotations

import os
import subprocess

import pytest
import torch
from test_model import run_chunks

from loramux.child_python import python_command
from loramux.engine.config import EngineConfig
from loramux.engine.engine import LLMEngine
from loramux.engine.sampling.params import SamplingParams
from loramux.model.loader import build_model, end_of_turn_ids

pytestmark = pytest.mark.real_model

QUESTIONS = [
    "What is the capital of France?",
    "Hi",
    "Write a haiku about the ocean.",
    "Explain in detail why the sky appears blue during the day but red and orange at sunset, "
    "covering Rayleigh scattering and the path length of light through the atmosphere.",
    "List three fruits.",
    "What is 12 times 12?",
    "Translate 'thank you very much' into French.",
    "Give me a short tip for learning to play the guitar as an adult beginner.",
    "Name a famous painter.",
]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def smol(smol_dir, tokenizer):
    model, cfg = build_model(smol_dir, torch.float32, torch.device("cpu"))
    engine = LLMEngine(model, tokenizer, EngineConfig(num_blocks=400, block_size=16, max_num_seqs=16,
                                                      max_num_batched_tokens=64),
                       end_of_turn_ids(tokenizer, cfg, smol_dir))
    return engine


@pytest.fixture(scope="module")
def hf_model(smol_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smol_dir, dtype=torch.float32).eval()


def test_continuous_batch_greedy_equals_hf_generate(smol, hf_model):
    prompts = [smol.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    params = SamplingParams(max_tokens=NEW_TOKENS)
    expected = []
    for ids in prompts:
        with torch.inference_mode():
            out = hf_model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
        gen = out[0, len(ids):].tolist()
        # HF keeps the EOS token it stopped on; the engine does too.
        expected.append(gen)

    # Five start together; the rest join while the first ones decode (the token budget of 64
    # also forces the long prompt through chunked prefill next to running decodes).
    for i in range(5):
        smol.add_request(f"q{i}", prompts[i], params)
    finished, step = {}, 0
    while smol.has_unfinished() or len(finished) < len(prompts):
        if step in (2, 4, 6, 8) and 5 + step // 2 - 1 < len(prompts):
            i = 5 + step // 2 - 1
            smol.add_request(f"q{i}", prompts[i], params)
        for out in smol.step():
            if out.finished:
                finished[out.request_id] = out
        step += 1
    for i, _ids in enumerate(prompts):
        assert finished[f"q{i}"].token_ids == expected[i], f"prompt {i} diverged from HF generate"
    assert finished["q0"].text.strip() == "The capital of France is Paris."
    assert smol.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize("question", [QUESTIONS[0], QUESTIONS[3]])
def test_last_position_logits_match_hf(smol, hf_model, question):
    ids = smol.encode_chat([{"role": "user", "content": question}])
    ours, *_ = run_chunks(smol.model, ids, chunk=48, block_size=16)
    with torch.inference_mode():
        ref = hf_model(torch.tensor([ids])).logits[0]
    assert (ours[-1] - ref[-1]).abs().max().item() < 1e-3
    assert (ours - ref).abs().max().item() < 1e-3


def test_cli_generate_answers_paris():
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(python_command("-m", "loramux.cli", "generate", "--chat", "What is the capital of France?"),
                          capture_output=True, text=True, timeout=300, env=env, cwd="/")
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    assert "tokens" in proc.stderr and "Paris" not in proc.stderr  # stats on stderr, text on stdout


def test_cli_generate_with_adapter(tmp_path, smol_dir):
    from loramux.model.loader import read_model_config
    from loramux.testing import write_peft_adapter

    cfg, _ = read_model_config(smol_dir)
    adapter = write_peft_adapter(tmp_path / "strong", cfg, 8, ["q_proj", "v_proj", "down_proj"], seed=5, b_std=0.5)
    generate = python_command("-m", "loramux.cli", "generate")
    options = ["--max-tokens", "12", "--chat", "What is the capital of France?"]
    base = subprocess.run(generate + options, capture_output=True, text=True, timeout=300)
    tuned = subprocess.run(generate + ["--adapter", str(adapter)] + options, capture_output=True, text=True,
                           timeout=300)
    assert base.returncode == 0 and tuned.returncode == 0, tuned.stderr
    assert tuned.stdout != base.stdout  # the adapter changes the answer
    bad = subprocess.run(generate + ["--adapter", str(tmp_path / "missing")] + options, capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode == 2 and "adapter_config.json is missing" in bad.stderr


def test_gguf_conversion_writes_a_loadable_model(tmp_path, smol_dir):
    from loramux.model.loader import embedded_gguf_path, ensure_converted, read_model_config

    target = ensure_converted(embedded_gguf_path(), tmp_path / "models" / "smol")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in target.iterdir()}
    assert not [p for p in (tmp_path / "models").iterdir() if p.name.startswith(".convert-")]  # no leftovers
    cfg, _ = read_model_config(target)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_kv_heads, cfg.tie_word_embeddings) == (30, 576, 3, True)
    fresh, _ = build_model(target, torch.float32, torch.device("cpu"))
    cached, _ = build_model(smol_dir, torch.float32, torch.device("cpu"))
    ids = list(range(100, 120))
    a, *_ = run_chunks(fresh, ids, 32, 16)
    b, *_ = run_chunks(cached, ids, 32, 16)
    assert torch.equal(a, b)
    assert ensure_converted(embedded_gguf_path(), target) == target  # second call: nothing to do
