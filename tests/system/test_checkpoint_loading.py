"""Loading base checkpoints as the Hub ships them: sharded with an index, in bfloat16, beside stray files;
host memory peaks near the model's own size plus one shard, with no float32 detour."""
from __future__ import annotations

import json
import subprocess
import textwrap

import pytest
import torch

from loramux.child_python import python_command
from loramux.model.loader import ModelNotFoundError, build_model
from loramux.testing import save_tiny_hf_model

VOCAB = 300


def params_of(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().float() for name, p in model.named_parameters()}


def test_a_sharded_bfloat16_checkpoint_loads_exactly_and_without_float32(tmp_path):
    one, sharded = tmp_path / "one", tmp_path / "sharded"
    hf = save_tiny_hf_model(one, VOCAB, "qwen3", head_dim=32)
    hf.to(torch.bfloat16).save_pretrained(sharded, max_shard_size="60KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 3
    ours = build_model(sharded, torch.bfloat16, torch.device("cpu"), pack_cpu=False)[0]
    assert all(p.dtype == torch.bfloat16 for n, p in ours.named_parameters() if "norm" not in n)
    # Exactly the checkpoint's bf16 values: the same as rounding the float32 model's parameters to bf16.
    ref = build_model(one, torch.float32, torch.device("cpu"), pack_cpu=False)[0]
    for name, value in params_of(ref).items():
        rounded = value.to(torch.bfloat16).float() if "norm" not in name else value.to(torch.bfloat16).float()
        torch.testing.assert_close(params_of(ours)[name], rounded, atol=0, rtol=0, msg=name)


def test_files_the_index_does_not_name_are_ignored_and_missing_shards_named(tmp_path):
    save_tiny_hf_model(tmp_path, VOCAB, "mistral")
    hf_dir = tmp_path / "sharded"
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tmp_path).save_pretrained(hf_dir, max_shard_size="60KB")
    (hf_dir / "consolidated.safetensors").write_bytes(b"not the weights this directory serves")
    build_model(hf_dir, torch.float32, torch.device("cpu"))  # the stray copy is not read
    shard = sorted(hf_dir.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(ModelNotFoundError, match=shard.name):
        build_model(hf_dir, torch.float32, torch.device("cpu"))


MEASURE = textwrap.dedent("""
    import resource, sys, torch
    from pathlib import Path
    from loramux.model.loader import build_model
    import loramux.engine.engine  # everything a server imports, before the baseline
    torch.zeros(1) + 1
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    model, _ = build_model(Path(sys.argv[1]), getattr(torch, sys.argv[2]), torch.device("cpu"), pack_cpu=False)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    print(peak - before, size)
""")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_loading_peaks_near_the_model_plus_one_shard(tmp_path, dtype):
    """A ~70M-parameter bf16 checkpoint in 5 shards: the load's extra peak memory stays under the model's size
    in `dtype` plus one shard plus 40 MB; a float32 detour for a bf16 model would add 2 x 140 MB."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", vocab_size=32000, hidden_size=512, intermediate_size=1536,
                                  num_hidden_layers=10, num_attention_heads=8, num_key_value_heads=4,
                                  tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    shard_bytes = 32 * 1024**2
    model.save_pretrained(tmp_path, max_shard_size=shard_bytes)
    del model
    out = subprocess.run(python_command("-c", MEASURE, str(tmp_path), dtype), capture_output=True, text=True,
                         timeout=300, check=True).stdout.split()
    extra, size = int(out[-2]), int(out[-1])
    assert extra < size + shard_bytes + 40 * 1024**2, (extra, size)
