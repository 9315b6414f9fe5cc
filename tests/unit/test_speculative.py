"""Speculative decoding by prompt lookup inside the engine: identical greedy outputs with it on and
off (base and mixed adapters), the sampled distribution kept exactly, and the switches."""
from __future__ import annotations

import torch

from conftest import make_engine, run_to_completion
from loramux.adapters.formats.peft import load_adapter_dir
from loramux.engine.sampling.params import SamplingParams
from loramux.model.loader import read_model_config
from loramux.testing import save_tiny_hf_model, write_peft_adapter


def varied_prompts(tokenizer) -> list[list[int]]:
    texts = ["one two three four one two three four one two", "The cat sat on the mat. The cat sat on the",
             "def f(x):\n    return x + 1\n\ndef g(x):\n    return x +", "a b c d e f g h i j k l m n o p",
             "Summarise: the meeting moved to Tuesday. The meeting moved to", "1, 2, 3, 4, 5, 6, 7, 8, 9,"]
    return [tokenizer.encode(t) for t in texts]


def test_greedy_outputs_are_identical_with_and_without_speculation(tiny_dir, tokenizer, tmp_path):
    cfg, _ = read_model_config(tiny_dir)
    adapters = [load_adapter_dir(write_peft_adapter(tmp_path / f"a{i}", cfg, 4, ["q_proj", "v_proj", "down_proj"],
                                                    seed=i, b_std=0.3), cfg, name=f"a{i}") for i in range(2)]
    prompts = varied_prompts(tokenizer)
    requests = [(p, SamplingParams(max_tokens=40, ignore_eos=True), [None, *adapters][i % 3])
                for i, p in enumerate(prompts)]
    outputs = {}
    for k in (0, 4):
        engine = make_engine(tiny_dir, tokenizer, speculative_tokens=k, speculative_max_batch=8, max_loras=2,
                             max_lora_rank=8)
        # alone (batch 1) and all together (a mixed-adapter batch)
        outputs[k] = ([run_to_completion(engine, [r])[0].token_ids for r in requests],
                      [o.token_ids for o in run_to_completion(engine, requests)])
        if k:
            stats = engine.stats()
            assert stats["spec_proposed_tokens"] > 50 and stats["spec_accepted_tokens"] > 10, stats
        assert engine.block_manager.num_used_blocks == 0
    assert outputs[4] == outputs[0]
    assert outputs[0][0] == outputs[0][1]


def test_per_request_switch_and_automatic_off_for_large_batches(tiny_dir, tokenizer):
    prompts = varied_prompts(tokenizer)[:4]

    def proposed(max_batch: int, speculative: bool) -> int:
        engine = make_engine(tiny_dir, tokenizer, speculative_tokens=4, speculative_max_batch=max_batch)
        run_to_completion(engine, [(p, SamplingParams(max_tokens=40, ignore_eos=True, speculative=speculative), None)
                     for p in prompts])
        return engine.stats()["spec_proposed_tokens"]

    assert proposed(8, True) > 0  # the control: these requests do draft
    assert proposed(8, False) == 0  # switched off per request
    assert proposed(2, True) == 0  # 4 decoding sequences > speculative_max_batch: off


def _chi_square_p(observed: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """p-value of Pearson's chi-square test, cells with expected count < 5 merged into one."""
    n = observed.sum()
    expected = expected_probs * n
    big = expected >= 5
    obs = torch.cat([observed[big], observed[~big].sum().reshape(1)])
    exp = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat.double() / 2))


def two_token_joint(hf, prompt: list[int], temperature: float) -> torch.Tensor:
    """The exact joint distribution p(t1) p(t2 | t1) of a 16-token HF model's next two tokens, flattened."""
    with torch.no_grad():
        p1 = torch.softmax(hf(torch.tensor([prompt])).logits[0, -1] / temperature, -1)
        p2 = torch.stack([torch.softmax(hf(torch.tensor([prompt + [x]])).logits[0, -1] / temperature, -1)
                          for x in range(16)])
    return (p1[:, None] * p2).flatten().double()


def test_sampling_keeps_the_model_distribution(tmp_path, tokenizer):
    """A 16-token vocabulary model: the joint distribution of the first two sampled tokens, with drafts
    proposed at every step, equals the model's exact p(t1) p(t2 | t1)."""
    from transformers import AutoModelForCausalLM

    path = tmp_path / "tiny16"
    model = save_tiny_hf_model(path, vocab_size=16, seed=3)
    with torch.no_grad():  # a random model's logits are nearly flat: sharpen them so the test has power
        model.lm_head.weight.mul_(40)
    model.save_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # The prompt repeats `head` after the model's own greedy continuation of it, so prompt lookup drafts
    # that continuation again: likely, but not certain, to be accepted.
    head = [3, 4, 5, 6]
    with torch.no_grad():
        continuation = hf.generate(torch.tensor([head]), max_new_tokens=4, do_sample=False)[0, 4:].tolist()
    prompt = head + continuation + head
    temperature = 1.0

    def joint_at(t: float) -> torch.Tensor:
        return two_token_joint(hf, prompt, t)

    joint = joint_at(temperature)

    n = 2000
    engine = make_engine(path, tokenizer, speculative_tokens=3, speculative_max_batch=64, max_num_seqs=64,
                         num_blocks=512)
    params = SamplingParams(max_tokens=2, temperature=temperature, ignore_eos=True)
    outs = run_to_completion(engine, [(prompt, params, None) for _ in range(n)])
    stats = engine.stats()
    assert stats["spec_proposed_tokens"] >= n // 10 and stats["spec_accepted_tokens"] > 0, stats
    counts = torch.zeros(256, dtype=torch.float64)
    for out in outs:
        t1, t2 = out.token_ids
        counts[t1 * 16 + t2] += 1
    p_value = _chi_square_p(counts, joint)
    assert p_value > 1e-3, p_value
    # and the test has teeth: the same samples are far from a subtly wrong distribution (temperature 1.3)
    assert _chi_square_p(counts, joint_at(1.3)) < 1e-6
