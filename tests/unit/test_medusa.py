"""Medusa heads: the file format's checks, training on the model's own answers, and speculation with them in
the engine: greedy outputs equal to decoding without speculation (mixed adapters, prefix caching, structured
output), the sampled distribution kept, per-request heads held while used."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from conftest import make_engine, run_to_completion
from loramux.adapters.formats.medusa import (
    MEDUSA_CONFIG,
    MEDUSA_WEIGHTS,
    MedusaFormatError,
    MedusaHeadsWeights,
    load_medusa_dir,
    save_medusa_dir,
    validate_medusa_files,
)
from loramux.adapters.formats.peft import load_adapter_dir
from loramux.engine.outputs import RequestError
from loramux.engine.sampling.params import SamplingParams, StructuredOutput
from loramux.model.loader import read_model_config
from loramux.testing import save_tiny_hf_model, write_peft_adapter
from loramux.training.medusa_train import hidden_features, train_heads
from loramux.training.self_distill import self_distilled

PROMPTS = ["Tell me about the sea.", "Write a poem about snow.", "What is two plus two?", "Name three colours.",
           "Explain gravity.", "Describe a city at night.", "Give me a recipe.", "Why is the sky blue?"]


def _files(path) -> dict[str, bytes]:
    return {MEDUSA_CONFIG: (path / MEDUSA_CONFIG).read_bytes(), MEDUSA_WEIGHTS: (path / MEDUSA_WEIGHTS).read_bytes()}


def test_heads_round_trip_and_refusals(tmp_path):
    blocks = [(torch.randn(8, 8), torch.randn(8)) for _ in range(2)]
    good = save_medusa_dir(tmp_path / "good", blocks, base_model="m")
    loaded = load_medusa_dir(good, 8)
    assert loaded.num_heads == 2 and all(torch.equal(a[0], b[0]) for a, b in zip(loaded.blocks, blocks))
    files = _files(good)

    def refused(files, hidden=8) -> MedusaFormatError:
        with pytest.raises(MedusaFormatError) as info:
            validate_medusa_files(files, hidden)
        return info.value

    assert refused(files, hidden=16).code == "base_mismatch"
    assert "hidden size 8" in str(refused(files, hidden=16))
    assert refused({MEDUSA_CONFIG: files[MEDUSA_CONFIG]}).code == "missing_file"
    assert refused({**files, "notes.txt": b"x"}).code == "unexpected_file"
    assert refused({**files, MEDUSA_CONFIG: b"{not json"}).code == "bad_config"
    utf16 = refused({**files, MEDUSA_CONFIG: files[MEDUSA_CONFIG].decode().encode("utf-16")})  # json.loads took it
    assert utf16.code == "bad_config" and "not UTF-8" in str(utf16)
    assert refused({**files, MEDUSA_CONFIG: b"[" * 50_000}).code == "bad_config"  # was a RecursionError
    for bad in ({"num_heads": 0}, {"num_heads": 9}, {"num_heads": True}, {"format": "medusa-2"}):
        config = {**json.loads(files[MEDUSA_CONFIG]), **bad}
        assert refused({**files, MEDUSA_CONFIG: json.dumps(config).encode()}).code == "bad_config", bad
    assert refused({**files, MEDUSA_WEIGHTS: b"\x80\x04\x95" + b"\0" * 64}).code == "pickle_refused"

    def weights(tensors) -> bytes:
        save_file(tensors, str(tmp_path / "w.safetensors"))
        return (tmp_path / "w.safetensors").read_bytes()

    t = {f"medusa_head.{i}.0.linear.{s}": torch.zeros((8, 8) if s == "weight" else (8,))
         for i in range(2) for s in ("weight", "bias")}
    extra = refused({**files, MEDUSA_WEIGHTS: weights({**t, "lm_head.weight": torch.zeros(4, 8)})})
    assert extra.code == "unexpected_tensor" and "lm_head.weight" in str(extra)
    assert refused({**files, MEDUSA_WEIGHTS: weights({k: v for k, v in t.items() if "1.0" not in k})}).code == \
        "missing_tensor"
    assert refused({**files, MEDUSA_WEIGHTS: weights({**t, "medusa_head.0.0.linear.bias": torch.zeros(7)})}).code \
        == "shape_mismatch"
    nan = torch.full((8,), float("nan"))
    assert refused({**files, MEDUSA_WEIGHTS: weights({**t, "medusa_head.0.0.linear.bias": nan})}).code == "non_finite"


def test_training_recovers_a_teacher_head():
    """Labels made by a hidden residual head: training finds heads that predict them on held-out rows."""
    gen = torch.Generator().manual_seed(0)
    hidden, vocab = 16, 32
    h = torch.randn(3000, hidden, generator=gen)
    lm_head = torch.randn(vocab, hidden, generator=gen)
    teacher = torch.randn(2, hidden, hidden, generator=gen)
    labels = torch.stack([((h + torch.nn.functional.silu(h @ teacher[k].t())) @ lm_head.t()).argmax(-1)
                          for k in range(2)], dim=1)
    untrained = train_heads(h, labels, lm_head, epochs=0, progress=False)
    result = train_heads(h, labels, lm_head, epochs=20, lr=1e-2, progress=False)
    assert all(a > 0.6 and a > b + 0.3 for a, b in zip(result.accuracy, untrained.accuracy)), (result, untrained)
    assert result.chain_accuracy[1] <= result.chain_accuracy[0]


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory, tokenizer):
    """A 16-token model, heads trained on its own greedy answers (what `loramux medusa train` does), and
    token-id prompts. A small vocabulary makes the model's continuations learnable by tiny heads."""
    from transformers import AutoModelForCausalLM

    path = tmp_path_factory.mktemp("tiny16")
    model = save_tiny_hf_model(path, vocab_size=16, seed=3)
    with torch.no_grad():  # sharper logits: a distribution test with power, and less aimless greedy text
        model.lm_head.weight.mul_(40)
    model.save_pretrained(path)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 16, (int(n),), generator=gen).tolist() for n in torch.randint(4, 12, (24,))]
    engine = make_engine(path, tokenizer)
    conversations = self_distilled(engine, prompts, max_tokens=24, progress=False)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hidden, labels = hidden_features(hf, conversations, 3, progress=False)
    result = train_heads(hidden, labels, hf.lm_head.weight, epochs=40, lr=1e-2, progress=False)
    heads = load_medusa_dir(result.save(path / "heads", base_model="tiny16", adapter=None), hf.config.hidden_size)
    return path, heads, prompts, result


def test_greedy_outputs_equal_without_speculation(small_vocab, tokenizer, tmp_path):
    path, heads, prompts, result = small_vocab
    assert result.accuracy[0] > 0.4, result.accuracy  # held-out: the heads learnt the model's continuations
    cfg, _ = read_model_config(path)
    adapters = [load_adapter_dir(write_peft_adapter(tmp_path / f"a{i}", cfg, 4, ["q_proj", "v_proj", "down_proj"],
                                                    seed=i, b_std=0.05), cfg, name=f"a{i}") for i in range(2)]
    shared = [1, 2, 3, 4, 5, 6, 7, 8] * 3
    requests = [(p, SamplingParams(max_tokens=30, ignore_eos=True), [None, *adapters][i % 3])
                for i, p in enumerate(prompts[:9])]
    requests += [(shared + p, SamplingParams(max_tokens=20, ignore_eos=True), None) for p in prompts[:3]]
    outputs = {}
    for k in (0, 3):
        engine = make_engine(path, tokenizer, speculative_tokens=k, speculative_methods="medusa",
                             speculative_max_batch=64, max_loras=2, max_lora_rank=8, prefix_caching=True)
        engine.set_medusa_heads(heads)
        single = [run_to_completion(engine, [r])[0] for r in requests[:3] + requests[-1:]]  # caches the prefix
        batch = run_to_completion(engine, requests)
        outputs[k] = ([o.token_ids for o in single], [o.token_ids for o in batch])
        assert engine.block_manager.num_used_blocks == 0
        if k:
            spec = engine.stats()["speculation"]
            assert spec["medusa"]["proposed"] > 100 and spec["medusa"]["accepted"] > 50, spec
            assert spec["ngram"]["proposed"] == 0 and spec["draft"]["proposed"] == 0
            assert any(o.speculation.get("medusa", {}).get("accepted") for o in batch)
            assert engine.stats()["prefix_cache_hit_blocks"] > 0
    assert outputs[3] == outputs[0]
    assert outputs[0][0] == outputs[0][1][:3] + outputs[0][1][-1:]


def test_structured_output_with_medusa_is_unchanged(tiny_dir, tokenizer):
    """Drafts are cut where the grammar rejects them; outputs equal decoding without speculation."""
    hidden = read_model_config(tiny_dir)[0].hidden_size
    zero = (torch.zeros(hidden, hidden), torch.zeros(hidden))  # proposes the model's next token again
    heads = MedusaHeadsWeights(2, hidden, [zero, zero], digest="zero")
    requests = [(p, SamplingParams(max_tokens=30, structured=StructuredOutput("regex", "(ab|a|b){2,20}")), None)
                for p in PROMPTS[:4]]
    requests += [(p, SamplingParams(max_tokens=20, ignore_eos=True), None) for p in PROMPTS[4:]]
    outputs = {}
    for k in (0, 2):
        engine = make_engine(tiny_dir, tokenizer, speculative_tokens=k, speculative_methods="medusa",
                             speculative_max_batch=64)
        engine.set_medusa_heads(heads)
        outputs[k] = [o.token_ids for o in run_to_completion(engine, requests)]
        if k:
            assert engine.stats()["speculation"]["medusa"]["proposed"] > 0, (engine.stats(), outputs)
    assert outputs[2] == outputs[0]


def test_request_heads_are_held_while_used_and_checked(small_vocab, tokenizer, tmp_path):
    path, heads, prompts, _ = small_vocab
    engine = make_engine(path, tokenizer, speculative_tokens=3, speculative_methods="medusa")
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    for i in range(2):
        engine.add_request(f"r{i}", prompts[i], params, medusa=engine.prepare_medusa(heads))
    assert engine.medusa_device.leases(heads.digest) == 2 and engine.medusa_device.stats()["builds"] == 1
    while engine.has_unfinished():
        engine.step()
    assert engine.medusa_device.leases(heads.digest) == 0  # given back, and still cached for the next request
    assert engine.stats()["speculation"]["medusa"]["accepted"] > 0
    wrong = load_medusa_dir(save_medusa_dir(tmp_path / "h8", [(torch.zeros(8, 8), torch.zeros(8))]), 8)
    with pytest.raises(RequestError, match="hidden size 8"):
        engine.prepare_medusa(wrong)
    with pytest.raises(RequestError, match="hidden size 8"):
        engine.add_request("bad", prompts[0], params, medusa=wrong)
    assert not engine.has_unfinished() and "bad" not in engine.requests


def test_sampling_with_medusa_keeps_the_model_distribution(small_vocab, tokenizer):
    """Heads proposing at every step: the joint distribution of two sampled tokens is the model's own
    p(t1) p(t2 | t1)."""
    from test_speculative import _chi_square_p, two_token_joint
    from transformers import AutoModelForCausalLM

    path, heads, _, _ = small_vocab
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = [3, 4, 5, 6, 7]

    def joint_at(t: float) -> torch.Tensor:
        return two_token_joint(hf, prompt, t)

    # Every decoding row speculates, however many share the step: with the default cap of 4 rows, how often
    # rows speculate would hang on how many the step budget (fitted to measured step times) lets decode at once.
    engine = make_engine(path, tokenizer, speculative_tokens=2, speculative_methods="medusa", max_num_seqs=64,
                         num_blocks=512, speculative_max_batch=64)
    engine.set_medusa_heads(heads)
    n = 2000
    outs = run_to_completion(engine, [(prompt, SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True), None)
                                      for _ in range(n)])
    spec = engine.stats()["speculation"]["medusa"]
    assert spec["proposed"] >= n // 2 and spec["accepted"] > n // 10, spec
    counts = torch.zeros(256, dtype=torch.float64)
    for out in outs:
        counts[out.token_ids[0] * 16 + out.token_ids[1]] += 1
    assert _chi_square_p(counts, joint_at(1.0)) > 1e-3
    assert _chi_square_p(counts, joint_at(1.3)) < 1e-6  # the test has teeth


def test_medusa_train_command_writes_heads_the_engine_loads(tokenizer, tmp_path, monkeypatch):
    from loramux.cli import main

    tiny_dir = tmp_path / "model"
    save_tiny_hf_model(tiny_dir, vocab_size=len(tokenizer), tokenizer=tokenizer)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS[:4]) + "\n")
    monkeypatch.setenv("LORAMUX_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "heads"
    assert main(["medusa", "train", "--model", str(tiny_dir), "--prompts", str(prompts), "--max-tokens", "12",
                 "--epochs", "1", "--heads", "2", "--out", str(out)]) == 0
    heads = load_medusa_dir(out, read_model_config(tiny_dir)[0].hidden_size)
    assert heads.num_heads == 2 and heads.config["base_model_name_or_path"] == str(tiny_dir)
    assert main(["medusa", "train", "--model", str(tiny_dir), "--heads", "9", "--out", str(out)]) == 2
