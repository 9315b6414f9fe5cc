"""Draft-model speculation: the DraftRunner's proposals are the draft's own greedy continuation (HF as the
reference) across calls that roll rejected drafts back, its paged KV never leaks and never raises when full,
incompatible drafts are refused by name, and `loramux draft distill` writes a draft that HF and loramux load
alike and that imitates its teacher better than the plain cut model did."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from loramux.engine.speculation.draft_runner import (
    DraftMismatchError,
    DraftRunner,
    check_draft_compatible,
    draft_from_settings,
)
from loramux.model.attention import AttentionMetadata, KVCache, PrefillChunk
from loramux.model.loader import build_model, read_model_config
from loramux.settings import Settings
from loramux.testing import save_tiny_hf_model

BLOCK = 4  # small, so contexts and drafts cross block boundaries


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory, tokenizer) -> Path:
    path = tmp_path_factory.mktemp("tiny-draft")
    save_tiny_hf_model(path, len(tokenizer), weight_scale=8.0, tokenizer=tokenizer, num_hidden_layers=2, seed=3)
    return path


@pytest.fixture(scope="module")
def hf_draft(draft_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def draft_model(draft_dir):
    return build_model(draft_dir, torch.float32, torch.device("cpu"))[0]


def kv_bytes_for(model, blocks: int) -> int:
    cfg = model.config
    return blocks * 2 * cfg.num_layers * BLOCK * cfg.num_kv_heads * cfg.head_dim * 4


def make_runner(model, blocks: int = 64, max_model_len: int = 256) -> DraftRunner:
    return DraftRunner(model, kv_bytes_for(model, blocks), BLOCK, torch.float32, torch.device("cpu"), max_model_len)


def hf_greedy(hf, context: list[int], k: int) -> list[int]:
    ids = list(context)
    with torch.no_grad():
        for _ in range(k):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(context) :]


def prompt(seed: int, n: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def check_blocks(runner: DraftRunner) -> None:
    runner.block_manager.check_invariants(list(runner.states.values()))


def test_proposals_follow_the_drafts_greedy_continuation_across_rollbacks(draft_model, hf_draft):
    vocab = draft_model.config.vocab_size
    runner = make_runner(draft_model)
    assert runner.kv_bytes == kv_bytes_for(draft_model, 64)
    contexts = {"a": prompt(1, 5, vocab), "b": prompt(2, 9, vocab), "c": prompt(3, 14, vocab)}
    ks = {"a": 4, "b": 3, "c": 5}
    proposals = runner.propose([(rid, contexts[rid], ks[rid]) for rid in contexts])
    for rid, ctx in contexts.items():
        assert proposals[rid] == hf_greedy(hf_draft, ctx, ks[rid]), rid
    check_blocks(runner)

    # The target accepts a prefix of each proposal and adds its own token (a correction, or a bonus token when
    # all were accepted); a new request joins; k changes.
    accepted = {"a": 2, "b": 3, "c": 0}
    for rid, n in accepted.items():
        correction = (proposals[rid][n] + 1) % vocab if n < len(proposals[rid]) else 7
        contexts[rid] = contexts[rid] + proposals[rid][:n] + [correction]
    contexts["d"] = prompt(4, 3, vocab)
    ks = {"a": 3, "b": 6, "c": 2, "d": 4}
    for round_ in range(3):
        requests = [(rid, contexts[rid], ks[rid]) for rid in contexts]
        proposals = runner.propose(requests)
        for rid, ctx in contexts.items():
            assert proposals[rid] == hf_greedy(hf_draft, ctx, ks[rid]), (round_, rid)
            # What the draft holds: the context and the drafts it fed back (all but the last).
            assert runner.states[rid].token_ids == ctx + proposals[rid][:-1]
        check_blocks(runner)
        for i, rid in enumerate(contexts):
            n = (i + round_) % (ks[rid] + 1)
            extra = [(proposals[rid][n] + 3) % vocab] if n < ks[rid] else []
            contexts[rid] = contexts[rid] + proposals[rid][:n] + extra

    for rid in list(contexts):
        runner.release(rid)
    runner.release("never-seen")
    assert runner.states == {}
    assert runner.num_free_blocks == runner.block_manager.num_blocks
    check_blocks(runner)


def test_a_rollback_gives_back_the_blocks_it_no_longer_needs(draft_model):
    vocab = draft_model.config.vocab_size
    runner = make_runner(draft_model, blocks=16)
    ctx = prompt(5, 10, vocab)
    drafts = runner.propose([("r", ctx, 8)])["r"]  # holds 10 + 7 tokens: 5 blocks
    assert len(runner.states["r"].block_table) == 5
    runner.propose([("r", ctx[:4] + [(ctx[4] + 1) % vocab], 1)])  # 5 tokens, nothing fed back: 2 blocks
    assert len(runner.states["r"].block_table) == 2
    assert runner.num_free_blocks == 14
    check_blocks(runner)
    assert len(drafts) == 8


def test_out_of_blocks_gives_no_draft_and_holds_nothing(draft_model, hf_draft):
    vocab = draft_model.config.vocab_size
    runner = make_runner(draft_model, blocks=4)  # 16 tokens of KV
    small, big = prompt(6, 5, vocab), prompt(7, 30, vocab)
    proposals = runner.propose([("big", big, 4), ("small", small, 3)])
    assert proposals == {"big": [], "small": hf_greedy(hf_draft, small, 3)}
    assert "big" not in runner.states
    check_blocks(runner)
    # The small request grows past what is left: it gets [] and gives its blocks back, never raising.
    assert runner.propose([("small", small + proposals["small"] + prompt(8, 12, vocab), 4)]) == {"small": []}
    assert runner.num_free_blocks == 4
    # k < 1, an empty context, a context at max_model_len: nothing to propose.
    capped = make_runner(draft_model, blocks=16, max_model_len=8)
    out = capped.propose([("z", small, 0), ("e", [], 3), ("full", prompt(9, 8, vocab), 3), ("cut", small, 9)])
    assert out["z"] == out["e"] == out["full"] == []
    assert out["cut"] == hf_greedy(hf_draft, small, 3)  # cut to max_model_len - len(context)
    check_blocks(capped)


def test_a_kv_budget_below_one_block_is_refused(draft_model):
    with pytest.raises(ValueError, match="holds no block"):
        DraftRunner(draft_model, 100, BLOCK, torch.float32, "cpu", 64)


class RenamedToken:
    """A tokenizer whose token `token_id` has another string (same size, same special tokens)."""

    def __init__(self, tokenizer, token_id: int, text: str):
        self.inner, self.token_id, self.text = tokenizer, token_id, text

    def __len__(self):
        return len(self.inner)

    def get_vocab(self):
        vocab = {t: i for t, i in self.inner.get_vocab().items() if i != self.token_id}
        vocab[self.text] = self.token_id
        return vocab

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_incompatible_drafts_are_refused_by_name(tokenizer, smol_dir):
    from transformers import AutoTokenizer

    cfg = SimpleNamespace(vocab_size=len(tokenizer))
    check_draft_compatible(tokenizer, tokenizer, cfg, cfg)  # the same tokenizer: fine

    with pytest.raises(DraftMismatchError, match=r"vocab_size is 32000, the target's is 49152.*same tokenizer"):
        check_draft_compatible(tokenizer, tokenizer, cfg, SimpleNamespace(vocab_size=32000))
    bigger = AutoTokenizer.from_pretrained(smol_dir)
    bigger.add_tokens(["<extra_token_for_test>"])
    with pytest.raises(DraftMismatchError, match=r"draft tokenizer has 49153 tokens, the target's has 49152"):
        check_draft_compatible(tokenizer, bigger, cfg, cfg)
    with pytest.raises(DraftMismatchError, match=r"token id 1234 is 'zzz' in the draft tokenizer but .* target's"):
        check_draft_compatible(tokenizer, RenamedToken(tokenizer, 1234, "zzz"), cfg, cfg)
    other_eos = AutoTokenizer.from_pretrained(smol_dir, eos_token="<|endoftext|>")
    assert other_eos.eos_token != tokenizer.eos_token
    with pytest.raises(DraftMismatchError, match=r"eos token differs: the draft's is '<\|endoftext\|>'"):
        check_draft_compatible(tokenizer, other_eos, cfg, cfg)
    assert issubclass(DraftMismatchError, ValueError)


def test_draft_from_settings(draft_dir, tokenizer, tmp_path, hf_draft):
    target_cfg, _ = read_model_config(draft_dir)
    settings = Settings(cache_dir=tmp_path, block_size=BLOCK, draft_kv_cache_bytes=1 << 20)
    assert settings.draft_model is None and Settings().draft_kv_cache_bytes == 64 * 1024**2
    assert draft_from_settings(settings, tokenizer, target_cfg, torch.float32, "cpu", 128) is None
    settings = settings.model_copy(update={"draft_model": str(draft_dir)})
    runner = draft_from_settings(settings, tokenizer, target_cfg, torch.float32, "cpu", 128)
    assert runner.kv_bytes <= 1 << 20 and runner.block_size == BLOCK
    ctx = prompt(11, 6, target_cfg.vocab_size)
    assert runner.propose([("x", ctx, 3)])["x"] == hf_greedy(hf_draft, ctx, 3)
    with pytest.raises(DraftMismatchError, match="vocab_size"):
        draft_from_settings(settings, tokenizer, SimpleNamespace(vocab_size=100), torch.float32, "cpu", 128)


# -- loramux draft distill ------------------------------------------------------------------------------
def loramux_logits(model_dir: Path, ids: list[int]) -> torch.Tensor:
    model, cfg = build_model(model_dir, torch.float32, torch.device("cpu"))
    kv = KVCache(cfg.num_layers, 8, 16, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    n = len(ids)
    meta = AttentionMetadata(torch.arange(n), [PrefillChunk(0, n, n, torch.arange(8))], n)
    return model.compute_logits(model(torch.tensor(ids), torch.arange(n), kv, meta))


def test_draft_distill_writes_a_draft_hf_and_loramux_load_alike(tmp_path, tokenizer, monkeypatch):
    from transformers import AutoModelForCausalLM

    from loramux.cli import main

    base = tmp_path / "base"
    save_tiny_hf_model(
        base,
        len(tokenizer),
        weight_scale=4.0,
        tokenizer=tokenizer,
        num_hidden_layers=3,
        tie_word_embeddings=True,
        seed=5,
    )
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(f"Tell me about topic number {i}." for i in range(10)) + "\n")
    monkeypatch.setenv("LORAMUX_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("LORAMUX_KV_CACHE_BYTES", str(8 << 20))
    monkeypatch.setenv("LORAMUX_MAX_MODEL_LEN", "256")
    out = tmp_path / "draft"
    argv = [
        "draft",
        "distill",
        "--out",
        str(out),
        "--model",
        str(base),
        "--layers",
        "1",
        "--prompts",
        str(prompts),
        "--max-tokens",
        "12",
        "--steps",
        "12",
        "--batch-size",
        "4",
        "--lr",
        "3e-3",
        "--held-out",
        "0.2",
    ]
    assert main(argv) == 0

    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 1 and config["tie_word_embeddings"] is True
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).is_file(), name
    report = json.loads((out / "distill.json").read_text())
    assert report["layers"] == 1 and report["train_conversations"] == 8 and report["held_out_conversations"] == 2
    assert report["train_kl_after"] < report["train_kl_before"]  # distillation lowers the KL
    assert 0 <= report["agreement_after"] <= 1

    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    teacher = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    # Embedding and head are the base's, untouched; the layer trained.
    assert torch.equal(hf.model.embed_tokens.weight, teacher.model.embed_tokens.weight)
    assert not torch.equal(hf.model.layers[0].mlp.down_proj.weight, teacher.model.layers[0].mlp.down_proj.weight)
    ids = tokenizer.encode("Tell me about topic number 3, in a few words.")
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(loramux_logits(out, ids), expected, rtol=1e-4, atol=1e-4)

    # A second run reuses the cached answers (no engine) and trains another depth.
    assert main([*argv[:6], "--layers", "2", "--prompts", str(prompts), "--max-tokens", "12", "--steps", "2"]) == 0
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 2


def test_distill_rejects_more_layers_than_the_base(tmp_path, tokenizer, monkeypatch):
    from loramux.training.draft_distill import truncated_draft

    base = tmp_path / "base"
    teacher = save_tiny_hf_model(base, len(tokenizer), num_hidden_layers=2)
    with pytest.raises(ValueError, match="between 1 and the base model's 2 layers"):
        truncated_draft(teacher, 3)


def test_engine_with_a_draft_model_gives_the_same_greedy_text(draft_dir, tiny_dir, tokenizer, tmp_path):
    """The target verifies the draft's proposals: outputs equal decoding without speculation, for base and
    adapter rows in one batch, with prefix caching and structured output; the draft's KV is freed as requests
    end."""
    from conftest import make_engine, run_to_completion
    from loramux.adapters.formats.peft import load_adapter_dir
    from loramux.engine.sampling.params import SamplingParams, StructuredOutput
    from loramux.testing import write_peft_adapter

    cfg, _ = read_model_config(tiny_dir)
    adapter = load_adapter_dir(write_peft_adapter(tmp_path / "a", cfg, 4, ["q_proj", "v_proj"], seed=1), cfg,
                               name="a")
    texts = ["one two three four one two three", "The cat sat on the mat. The cat", "a b c d e f g",
             "Summarise: the meeting moved to Tuesday."]
    shared = tokenizer.encode("A shared system prompt that several requests start with, long enough. " * 2)
    requests = [(tokenizer.encode(t), SamplingParams(max_tokens=24, ignore_eos=True), [None, adapter][i % 2])
                for i, t in enumerate(texts)]
    requests += [(shared + tokenizer.encode(t), SamplingParams(max_tokens=16, ignore_eos=True), None)
                 for t in texts[:2]]
    requests += [(tokenizer.encode(texts[0]), SamplingParams(max_tokens=20, structured=StructuredOutput(
        "regex", "(ab|a|b){2,12}")), None)]
    outputs = {}
    for k in (0, 3):
        engine = make_engine(tiny_dir, tokenizer, speculative_tokens=k, speculative_methods="draft",
                             speculative_max_batch=64, max_lora_rank=8, prefix_caching=True)
        draft_model = build_model(draft_dir, torch.float32, torch.device("cpu"))[0]
        runner = DraftRunner(draft_model, 4 * 1024**2, 16, torch.float32, "cpu", 512)
        engine.set_draft_model(runner)
        first = run_to_completion(engine, requests[-2:-1])  # caches the shared prefix
        outputs[k] = [o.token_ids for o in first + run_to_completion(engine, requests)]
        assert engine.block_manager.num_used_blocks == 0
        if k:
            spec = engine.stats()["speculation"]["draft"]
            assert spec["proposed"] > 50 and spec["verifications"] > 10, spec
            assert runner.num_free_blocks == runner.block_manager.num_blocks  # every request's draft KV freed
    assert outputs[3] == outputs[0]
