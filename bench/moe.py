"""Mixture of experts at Qwen3-30B-A3B's layer shapes: grouped experts, expert LoRA, and vLLM's CPU build.

The stack: random weights of Qwen3-30B-A3B's layers (model_type qwen3_moe: hidden 2048, 128 experts, top-8,
moe_intermediate 768, 32 heads, 4 KV heads, head_dim 128, q/k norms, rms_norm_eps 1e-6), --layers of them (4:
what two engines' copies fit in this VM's 24 GB), bfloat16 (--dtype), with a vocabulary of 1024 (--vocab) so that
the embedding and LM head are negligible and the figures measure the layer stack; prompts are token ids, so no
tokenizer matters (SmolLM2's is copied beside the weights: vLLM wants one). The config comes from transformers'
own class (`AutoConfig.for_model("qwen3_moe", ...)`), the weights are written directly as safetensors under the
Hub checkpoint's per-expert names (`model.layers.{i}.mlp.experts.{e}.gate_proj.weight` ...), matrices ~ N(0,
0.02^2), norms 1; once, into ~/.cache/loramux-bench/models/ (--models-dir).

Workload: batch 8, prompts of 16 random token ids, exactly --new-tokens (64) new tokens per request, greedy, EOS
ignored, loramux's LLMEngine in this process (prefix caching and speculation off, adapters loaded inline), 2
threads pinned to 2 cores (the same for vLLM). Each configuration is warmed up once; then --rounds (3) rounds
alternate the order; medians of tok/s (the batch's new tokens / wall time of the batch, prefill included; loramux's
decode-only tok/s is printed beside). Three comparisons:

* `moe_mixed_vs_base`: 8 distinct random expert-LoRA adapters, r=16 (PEFT `target_parameters` on
  mlp.experts.gate_up_proj and down_proj, lora_alpha 32), one per row, vs the same batch with no adapter. The
  physical ceiling is printed beside it: bytes of weights a decode step reads without adapters (distinct experts
  touched x one expert's bytes, per layer, plus attention, router, norms and the LM head) against those the
  adapters add (each of the step's (row, expert) pairs reads its own A and B: 64 pairs x r x (in + out) per
  projection and layer), ceiling = base / (base + LoRA). Target >= 0.6.
* `moe_base_vs_vllm`: the same stack, no adapter, in vLLM's CPU build (bench/vllm_peer.py's venv; an in-process
  `vllm.LLM` in a worker process this script starts as `--vllm-worker`), same dtype, prompts, lengths and threads;
  loramux tok/s / vLLM tok/s; the first round's greedy outputs are compared. `n/a` with a NOTE line when vLLM is
  unavailable or refuses the model (its reason printed).
* `moe_grouped_vs_dense`: one MoE block (router, experts, combine) at batch 8 on hidden states captured from the
  engine's own decode steps, loramux's grouped dispatch vs every expert computed for every token
  (`loramux.kernels.moe.dense_expert_matmul`, then the down projection batched over experts); dense time /
  grouped time, per layer and overall, beside the factor the routing implies (experts / distinct experts the
  step touched).

`--smoke` (what tests/system/test_moe_bench.py runs): `--tiny` (a toy MoE: hidden 64, 8 experts, top-2, in a
temporary directory), 4 new tokens, one round, no vLLM; the same code paths and FIGURE lines in seconds, figures
meaningless.
`--profile` adds torch.profiler's top operators of a few mixed-adapter decode steps. A full run takes ~2.5 min once
the checkpoint (5 GB) and adapters (0.8 GB) are written (~1.5 min, once); run it on a quiet machine, or at `nice -n
-15` where test suites come and go: two OpenMP threads on two cores stall whenever a neighbour takes one.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODELS_DIR = Path.home() / ".cache" / "loramux-bench" / "models"
RANK, ALPHA = 16, 32
EXPERT_TARGETS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
PROMPT_LEN = 16
MAX_MODEL_LEN = 1024  # both engines; prompts and outputs stay far below
T0 = time.perf_counter()

# Qwen3-30B-A3B's config.json (the layer shapes), as transformers' Qwen3MoeConfig takes it; vocab and layer count
# are the bench's (--vocab, --layers).
QWEN3_30B_A3B = dict(
    hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
    num_attention_heads=32, num_key_value_heads=4, head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6,
    max_position_embeddings=40960, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
    attention_bias=False, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
# --tiny (and --smoke): the same family at toy sizes (gate_up's width 96 differs from the hidden 64, so every
# expert weight's orientation is unambiguous; head_dim 32: vLLM's CPU attention has no kernel for 16).
TINY = dict(QWEN3_30B_A3B, hidden_size=64, intermediate_size=128, moe_intermediate_size=48, num_experts=8,
            num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            max_position_embeddings=2048)


def num_experts(cfg: dict) -> int:
    """Routed experts of a config.json (transformers 5 writes Qwen3-MoE's `num_experts` as `num_local_experts`)."""
    return int(cfg.get("num_experts") or cfg["num_local_experts"])


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


# --- checkpoint and adapters -------------------------------------------------------------------------------


def build_checkpoint(out: Path, config_kwargs: dict, dtype: str, tokenizer_dir: Path | None) -> Path:
    """Write random weights of qwen3_moe at `config_kwargs` into `out` as `dtype` safetensors, one shard per
    layer under the Hub checkpoint's names (per-expert projections), with config.json from transformers'
    Qwen3MoeConfig and the tokenizer of `tokenizer_dir` beside them; once (a stamp marks a finished directory)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer

    stamp = out / ".complete"
    if stamp.is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    config = AutoConfig.for_model("qwen3_moe", **config_kwargs)
    config.architectures = ["Qwen3MoeForCausalLM"]  # vLLM picks its model class (and runner) from this
    config.dtype = getattr(torch, dtype)
    h, n_layers, n_exp = config.hidden_size, config.num_hidden_layers, config.num_experts
    q_out, kv_out = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    wdtype, g = getattr(torch, dtype), torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.empty(shape).normal_(0.0, 0.02, generator=g).to(wdtype)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=wdtype)

    weight_map: dict[str, str] = {}

    def save(tensors: dict[str, torch.Tensor], name: str) -> None:
        save_file(tensors, out / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))

    shards = n_layers + 1
    save({"model.embed_tokens.weight": rand(config.vocab_size, h), "model.norm.weight": ones(h),
          "lm_head.weight": rand(config.vocab_size, h)}, f"model-00001-of-{shards:05d}.safetensors")
    for i in range(n_layers):
        p = f"model.layers.{i}"
        tensors = {f"{p}.input_layernorm.weight": ones(h), f"{p}.post_attention_layernorm.weight": ones(h),
                   f"{p}.self_attn.q_proj.weight": rand(q_out, h), f"{p}.self_attn.k_proj.weight": rand(kv_out, h),
                   f"{p}.self_attn.v_proj.weight": rand(kv_out, h), f"{p}.self_attn.o_proj.weight": rand(h, q_out),
                   f"{p}.self_attn.q_norm.weight": ones(config.head_dim),
                   f"{p}.self_attn.k_norm.weight": ones(config.head_dim), f"{p}.mlp.gate.weight": rand(n_exp, h)}
        width = config.moe_intermediate_size
        for e in range(n_exp):
            tensors[f"{p}.mlp.experts.{e}.gate_proj.weight"] = rand(width, h)
            tensors[f"{p}.mlp.experts.{e}.up_proj.weight"] = rand(width, h)
            tensors[f"{p}.mlp.experts.{e}.down_proj.weight"] = rand(h, width)
        save(tensors, f"model-{i + 2:05d}-of-{shards:05d}.safetensors")
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config.save_pretrained(out)
    if tokenizer_dir is not None:
        AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)
    stamp.write_text("ok\n")
    return out


def write_expert_adapter(path: Path, cfg: dict, seed: int, dtype: str) -> Path:
    """A random PEFT LoRA on the routed experts (target_parameters on gate_up_proj and down_proj, r=RANK,
    lora_alpha=ALPHA) for the qwen3_moe `cfg` (config.json as a dict), in PEFT's file layout: per layer
    `mlp.experts.base_layer.lora_A` [E*r, hidden] / `lora_B` [2*width, E*r] (gate_up) and `mlp.experts.lora_A`
    [E*r, width] / `lora_B` [hidden, E*r] (down). A ~ N(0, 1/d_in), B ~ N(0, 0.02^2). Once per directory."""
    import torch
    from safetensors.torch import save_file

    if (path / "adapter_model.safetensors").is_file():
        return path
    h, width, n_exp = cfg["hidden_size"], cfg["moe_intermediate_size"], num_experts(cfg)
    g, wdtype, tensors = torch.Generator().manual_seed(seed), getattr(torch, dtype), {}
    for layer in range(cfg["num_hidden_layers"]):
        prefix = f"base_model.model.model.layers.{layer}.mlp.experts"
        for key, d_in, d_out in ((f"{prefix}.base_layer", h, 2 * width), (prefix, width, h)):
            a = torch.randn(n_exp * RANK, d_in, generator=g) / d_in**0.5
            tensors[f"{key}.lora_A.weight"] = a.to(wdtype)
            tensors[f"{key}.lora_B.weight"] = (torch.randn(d_out, n_exp * RANK, generator=g) * 0.02).to(wdtype)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path / "adapter_model.safetensors")
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RANK, "lora_alpha": ALPHA, "target_modules": [],
              "target_parameters": EXPERT_TARGETS, "lora_dropout": 0.0, "bias": "none", "use_rslora": False,
              "fan_in_fan_out": False, "base_model_name_or_path": None}
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


def adapter_bytes(cfg: dict, elem: int) -> int:
    """Bytes of one expert adapter's A and B in the device pool (elements of `elem` bytes)."""
    h, width, n_exp = cfg["hidden_size"], cfg["moe_intermediate_size"], num_experts(cfg)
    return cfg["num_hidden_layers"] * n_exp * RANK * ((h + 2 * width) + (width + h)) * elem


# --- bytes a decode step reads -----------------------------------------------------------------------------


def step_bytes(cfg: dict, elem: int, distinct_per_layer: list[float], pairs: int) -> tuple[float, float]:
    """(base, LoRA) bytes of weights a decode step reads: per layer the distinct experts touched x one expert's
    gate, up and down, attention (q, k, v, o), router and norms; the final norm and the LM head; the KV cache and
    the embedding rows are left out (under 1 % here). LoRA: each of the `pairs` (row, expert) pairs of a layer
    reads its own A and B for gate_up (r x (hidden + 2 width)) and down (r x (width + hidden))."""
    h, width, n_exp = cfg["hidden_size"], cfg["moe_intermediate_size"], num_experts(cfg)
    q_out = cfg["num_attention_heads"] * cfg["head_dim"]
    kv_out = cfg["num_key_value_heads"] * cfg["head_dim"]
    attention = h * q_out + 2 * h * kv_out + q_out * h + 2 * cfg["head_dim"]
    per_layer_fixed = attention + n_exp * h + 2 * h
    expert = 3 * h * width
    base = sum(per_layer_fixed + d * expert for d in distinct_per_layer) + h + cfg["vocab_size"] * h
    lora = len(distinct_per_layer) * pairs * RANK * ((h + 2 * width) + (width + h))
    return base * elem, lora * elem


# --- loramux -----------------------------------------------------------------------------------------------


def make_engine(model_dir: Path, dtype: str, num_adapters: int, cfg: dict, batch: int):
    import torch
    from transformers import AutoTokenizer

    from loramux.engine.config import EngineConfig
    from loramux.engine.engine import LLMEngine
    from loramux.model.loader import build_model

    torch_dtype = getattr(torch, dtype)
    model, _ = build_model(model_dir, torch_dtype, torch.device("cpu"), max_positions=MAX_MODEL_LEN)
    elem = torch.finfo(torch_dtype).bits // 8
    # Room for every adapter at once, plus a quarter for the pool's own rounding.
    pool = int(1.25 * num_adapters * adapter_bytes(cfg, elem)) + 64 * 2**20
    config = EngineConfig(max_num_seqs=batch, max_num_batched_tokens=max(512, batch * PROMPT_LEN),
                          max_model_len=MAX_MODEL_LEN, kv_cache_bytes=256 * 2**20, max_lora_rank=RANK,
                          adapter_pool_bytes=pool, async_adapter_loads=False, prefix_caching=False,
                          speculative_tokens=0, step_target_ms=None)  # prefill in one step, not cut to a time target
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return LLMEngine(model, tokenizer, config, (), torch_dtype, torch.device("cpu")), pool


def loramux_generate(engine, prompts: list[list[int]], adapters: list[str | None], new_tokens: int
                     ) -> tuple[float, float, list[list[int]]]:
    """One batch to completion: (seconds, seconds after every row had its first token, token ids per request)."""
    from loramux.engine.sampling.params import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, min_tokens=new_tokens, temperature=0, ignore_eos=True)
    ids = [f"moe-{time.monotonic_ns()}-{j}" for j in range(len(prompts))]
    final: dict[str, list[int]] = {}
    started: set[str] = set()
    start = time.perf_counter()
    first = None
    for rid, prompt, adapter in zip(ids, prompts, adapters):
        engine.add_request(rid, prompt, params, adapter=adapter)
    while engine.has_unfinished():
        for out in engine.step():
            started.add(out.request_id)
            if out.finished:
                final[out.request_id] = list(out.token_ids)
        if first is None and len(started) == len(ids):
            first = time.perf_counter()
    end = time.perf_counter()
    return end - start, end - (first or start), [final.get(rid, []) for rid in ids]


def load_unpacked(model_dir: Path, dtype: str):
    """The model with its float weight stacks (no oneDNN packing), for the grouped-vs-dense comparison."""
    import torch

    from loramux.model.loader import build_model

    model, _ = build_model(model_dir, getattr(torch, dtype), torch.device("cpu"), max_positions=MAX_MODEL_LEN,
                           pack_cpu=False)
    return model


def moe_blocks(model) -> list:
    from loramux.model.moe import MoEBlock

    return [m for m in model.modules() if isinstance(m, MoEBlock)]


class DecodeCapture:
    """Forward pre-hooks on every MoE block that keep the block inputs of decode steps at batch `batch` (the
    last `keep` per layer) while `on`."""

    def __init__(self, blocks: list, batch: int, keep: int = 8):
        self.inputs: list[list] = [[] for _ in blocks]
        self.on = False
        self.handles = [b.register_forward_pre_hook(self._hook(i, batch, keep)) for i, b in enumerate(blocks)]

    def _hook(self, index: int, batch: int, keep: int):
        def hook(module, args):
            if self.on and args[0].shape[0] == batch:
                self.inputs[index] = [*self.inputs[index][-(keep - 1):], args[0].detach().clone()]
        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


# --- grouped vs dense --------------------------------------------------------------------------------------


def in_out_view(proj):
    """[E, in, out] view of an ExpertProjection's stacked weight, whichever orientation it is stored in."""
    w, d_in, d_out = proj.weight, proj.in_features, proj.out_features
    if d_in == d_out:
        raise ValueError("square expert weights: their orientation is ambiguous")
    if tuple(w.shape[1:]) == (d_in, d_out):
        return w
    if tuple(w.shape[1:]) == (d_out, d_in):
        return w.transpose(1, 2)
    raise ValueError(f"expert weight of shape {tuple(w.shape)} for {d_in} -> {d_out}")


def dense_block_forward(block, x):
    """The MoE block computing every expert for every token (the baseline): router and routing as loramux's,
    gate_up through `dense_expert_matmul`, the down projection as one batched matmul over experts, then each
    token's top-k outputs weighted and summed."""
    import torch

    from loramux.kernels.moe import dense_expert_matmul
    from loramux.model.moe import activate, route

    weights, ids = route(block.router(x), block.moe)
    gu, down = block.experts.gate_up_proj, block.experts.down_proj
    hidden = activate(dense_expert_matmul(x, in_out_view(gu), gu.bias), block.moe)  # [E, T, width]
    y = torch.matmul(hidden, in_out_view(down))  # [E, T, hidden]
    if down.bias is not None:
        y = y + down.bias.unsqueeze(1)
    picked = y[ids, torch.arange(x.shape[0]).unsqueeze(1)]  # [T, k, hidden]
    return (picked * weights.unsqueeze(-1).to(picked.dtype)).sum(1).to(x.dtype)


@dataclass
class DenseResult:
    grouped_ms: list[float]  # per layer, median
    dense_ms: list[float]
    distinct: list[float]  # per layer: mean distinct experts of the captured steps
    max_diff: float
    num_experts: int


def grouped_vs_dense(blocks: list, dense_blocks: list, inputs: list[list], reps: int) -> DenseResult:
    """Time each block on its captured decode inputs: grouped (the engine's own forward, no LoRA; its experts
    packed for oneDNN) and dense (every expert for every token, on `dense_blocks`: the same weights unpacked)."""
    import torch

    from loramux.model.moe import route

    grouped_ms, dense_ms, distinct, max_diff = [], [], [], 0.0
    with torch.inference_mode():
        for block, dense_block, xs in zip(blocks, dense_blocks, inputs):
            saved = (block.experts.gate_up_proj.lora_wrapper, block.experts.down_proj.lora_wrapper,
                     block.expert_counter)
            block.experts.gate_up_proj.lora_wrapper = block.experts.down_proj.lora_wrapper = None
            block.expert_counter = None
            try:
                times = {"grouped": [], "dense": []}
                for x in xs:
                    distinct.append(float(route(block.router(x), block.moe)[1].unique().numel()))
                    ref, got = block(x), dense_block_forward(dense_block, x)
                    max_diff = max(max_diff, (ref.float() - got.float()).abs().max().item())
                    for _ in range(reps):
                        for name, fn in (("grouped", block),
                                         ("dense", lambda t, b=dense_block: dense_block_forward(b, t))):
                            t0 = time.perf_counter()
                            fn(x)
                            times[name].append((time.perf_counter() - t0) * 1e3)
                grouped_ms.append(statistics.median(times["grouped"]))
                dense_ms.append(statistics.median(times["dense"]))
            finally:
                (block.experts.gate_up_proj.lora_wrapper, block.experts.down_proj.lora_wrapper,
                 block.expert_counter) = saved
    per_layer = [statistics.mean(distinct[i * len(xs):(i + 1) * len(xs)]) for i, xs in enumerate(inputs)]
    return DenseResult(grouped_ms, dense_ms, per_layer, max_diff, blocks[0].moe.num_experts)


# --- vLLM --------------------------------------------------------------------------------------------------


def start_vllm(model_dir: Path, dtype: str, threads: int, cpus: list[int], batch: int, kv_cache_gib: int):
    """This script as a `--vllm-worker` in vLLM's venv, speaking bench/vs_vllm_worker.py's protocol (so
    vs_vllm.VLLMWorker's generate and close drive it); VLLMUnavailable when it cannot start."""
    import shutil
    import subprocess

    import vllm_peer
    from vs_vllm import VLLMWorker, worker_log_path

    class Worker(VLLMWorker):
        def __init__(self):  # VLLMWorker's, with this script's worker: a dtype of our choice and no LoRA
            self.adapters = {}
            peer = vllm_peer.VLLMServer(model_dir, {}, max_loras=1, max_lora_rank=RANK, max_cpu_loras=1,
                                        threads=threads, kv_cache_gib=kv_cache_gib, cpus=cpus)
            self.cpus = peer.cpus
            env = {**peer.environment(), "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONUNBUFFERED": "1"}
            python = vllm_peer.ensure_venv(peer.venv)
            cfg = {"model": str(Path(model_dir).resolve()), "dtype": dtype, "max_num_seqs": batch,
                   "max_model_len": MAX_MODEL_LEN}
            cmd = [str(python), "-P", str(Path(__file__).resolve()), "--vllm-worker", json.dumps(cfg)]
            if shutil.which("taskset"):
                cmd = ["taskset", "-c", ",".join(map(str, self.cpus)), *cmd]
            self.log_path = worker_log_path()
            self._log = open(self.log_path, "wb")
            self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=self._log, text=True, bufsize=1, start_new_session=True,
                                         cwd=peer.venv)
            try:
                self.info = self._read(900)
            except BaseException:
                self.close()
                raise
            if "error" in self.info or not self.info.get("ready"):
                self.close()
                raise vllm_peer.VLLMUnavailable(f"{self.info.get('error', self.info)}; log {self.log_path}:\n"
                                                f"{vllm_peer.log_tail(self.log_path)}")

    return Worker()


def vllm_worker_main(cfg: dict) -> int:
    """`--vllm-worker`: runs under vLLM's venv python. One `vllm.LLM` (no LoRA, prefix caching off), then
    bench/vs_vllm_worker.py's protocol on stdin / stdout."""
    import importlib.util

    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != str(HERE)]  # bench/ must shadow nothing
    spec = importlib.util.spec_from_file_location("vs_vllm_worker", HERE / "vs_vllm_worker.py")
    helper = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(helper)
    helper._reexec_with_preload()  # libgomp and tcmalloc preloaded, as vLLM's own engine processes have them
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def send(obj: dict) -> None:
        proto.write(json.dumps(obj) + "\n")
        proto.flush()

    t0 = time.perf_counter()
    try:
        import torch
        import vllm
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        llm = LLM(model=cfg["model"], tokenizer=cfg["model"], dtype=cfg["dtype"], max_num_seqs=cfg["max_num_seqs"],
                  max_model_len=cfg["max_model_len"], enable_prefix_caching=False, seed=0)
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which prints why vLLM is unavailable
        import traceback

        traceback.print_exc()
        send({"error": " ".join(f"vLLM failed to start: {type(exc).__name__}: {exc}".split())[:600]})
        return 1
    send({"ready": True, "startup_s": time.perf_counter() - t0, "vllm": vllm.__version__, "torch": torch.__version__})
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        if cmd.get("cmd") == "quit":
            break
        try:
            params = SamplingParams(temperature=0, max_tokens=cmd["max_tokens"], ignore_eos=True)
            prompts = [TokensPrompt(prompt_token_ids=ids) for ids in cmd["prompts"]]
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            token_ids = [list(o.outputs[0].token_ids) for o in outs]
            send({"elapsed_s": elapsed, "counts": [len(t) for t in token_ids], "token_ids": token_ids})
        except Exception as exc:  # noqa: BLE001 - the parent fails loudly with this message
            import traceback

            traceback.print_exc()
            send({"error": f"{type(exc).__name__}: {exc}"})
    return 0


# --- main --------------------------------------------------------------------------------------------------


@dataclass
class Side:
    name: str
    tok_s: list[float] = field(default_factory=list)
    decode_tok_s: list[float] = field(default_factory=list)
    ids: list[list[int]] | None = None


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true",
                    help="smoke run (what the tests run): a tiny MoE, 4 new tokens, one round, no vLLM; seconds")
    ap.add_argument("--tiny", action="store_true", help="the toy shapes of --smoke, with everything else as asked")
    ap.add_argument("--loramux-only", action="store_true", help="do not start vLLM")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers of the stack (default 4)")
    ap.add_argument("--vocab", type=int, default=1024, help="vocabulary size (default 1024)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="weights (both engines)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds (default 3; --smoke 1)")
    ap.add_argument("--new-tokens", type=int, default=None, help="tokens per request (default 64; --smoke 4)")
    ap.add_argument("--warmup-tokens", type=int, default=None, help="tokens per request of the warm-up (default 8)")
    ap.add_argument("--dense-reps", type=int, default=None, help="timings per captured step and layer (default 3)")
    ap.add_argument("--threads", type=int, default=2, help="threads (and cores) per engine (default 2)")
    ap.add_argument("--kv-cache-gib", type=int, default=1, help="vLLM's KV cache (VLLM_CPU_KVCACHE_SPACE)")
    ap.add_argument("--models-dir", type=Path, default=MODELS_DIR, help="where the checkpoint and adapters are kept")
    ap.add_argument("--profile", action="store_true", help="also profile a few mixed-adapter decode steps")
    args = ap.parse_args(argv)
    args.loramux_only = args.loramux_only or args.smoke
    args.tiny = args.tiny or args.smoke
    args.rounds = args.rounds or (1 if args.smoke else 3)
    args.new_tokens = args.new_tokens or (4 if args.smoke else 64)
    args.warmup_tokens = min(args.warmup_tokens or (2 if args.smoke else 8), args.new_tokens)
    args.dense_reps = args.dense_reps or (1 if args.smoke else 3)
    return args


def prepare(args) -> tuple[Path, list[Path], dict]:
    """The checkpoint and the adapters' directories (built once), and config.json as a dict."""
    import tempfile

    from loramux.model.loader import resolve_model_dir
    from loramux.settings import Settings

    tokenizer_dir = resolve_model_dir("SmolLM2-135M-Instruct", Path(Settings().cache_dir))
    if args.tiny:
        root = Path(tempfile.mkdtemp(prefix="loramux-moe-smoke-"))
        import atexit
        import shutil

        atexit.register(shutil.rmtree, root, ignore_errors=True)
        kwargs = dict(TINY, num_hidden_layers=2, vocab_size=args.vocab)
        model_dir = root / "model"
    else:
        root = args.models_dir
        kwargs = dict(QWEN3_30B_A3B, num_hidden_layers=args.layers, vocab_size=args.vocab)
        model_dir = root / f"qwen3_30b_a3b-{args.layers}l-v{args.vocab}-{args.dtype}"
    log(f"checkpoint {model_dir}")
    build_checkpoint(model_dir, kwargs, args.dtype, tokenizer_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    adapters_dir = model_dir.parent / f"{model_dir.name}-expert-adapters"
    paths = [write_expert_adapter(adapters_dir / f"experts-r{RANK}-{i}", cfg, seed=100 + i, dtype=args.dtype)
             for i in range(args.batch)]
    log(f"{len(paths)} expert adapters in {adapters_dir}")
    return model_dir, paths, cfg


def profile_steps(engine, prompts, names, steps: int) -> None:
    """torch.profiler's top operators (self CPU time) over `steps` decode steps of the mixed batch."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from loramux.engine.sampling.params import SamplingParams

    params = SamplingParams(max_tokens=steps + 2, min_tokens=steps + 2, temperature=0, ignore_eos=True)
    for j, (prompt, name) in enumerate(zip(prompts, names)):
        engine.add_request(f"profile-{j}", prompt, params, adapter=name)
    engine.step()  # the prefill, outside the profile
    with profile(activities=[ProfilerActivity.CPU]) as prof, torch.inference_mode():
        for _ in range(steps):
            engine.step()
    while engine.has_unfinished():
        engine.step()
    print(f"\nprofile: {steps} decode steps, b{len(prompts)}, {len(set(names))} expert adapters (self CPU time)")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=40))


def run(args, cpus: list[int]) -> int:  # noqa: C901 - one linear script: build, warm up, rounds, report
    import torch

    from loramux.testing import describe_cpu

    model_dir, paths, cfg = prepare(args)
    elem = torch.finfo(getattr(torch, args.dtype)).bits // 8
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, cfg["vocab_size"], (PROMPT_LEN,), generator=g).tolist() for _ in range(args.batch)]
    names = [f"experts-{i}" for i in range(args.batch)]

    worker, vllm_note = None, None
    if args.loramux_only:
        vllm_note = "--smoke: vLLM not started" if args.smoke else "--loramux-only: vLLM not started"
    else:
        import vllm_peer

        log("starting vLLM's worker (its venv is built on first use)")
        try:
            worker = start_vllm(model_dir, args.dtype, args.threads, cpus, args.batch, args.kv_cache_gib)
            log(f"vLLM {worker.info['vllm']} (torch {worker.info['torch']}) up in {worker.info['startup_s']:.1f} s;"
                f" log {worker.log_path}")
        except vllm_peer.VLLMUnavailable as exc:
            vllm_note = f"vLLM unavailable: {exc}"
            log(vllm_note.splitlines()[0])

    log("building the loramux engine")
    engine, pool = make_engine(model_dir, args.dtype, len(paths), cfg, args.batch)
    for name, path in zip(names, paths):
        engine.load_adapter_dir(path, name)
    blocks = moe_blocks(engine.model)
    capture = DecodeCapture(blocks, args.batch)
    log(f"engine up: {len(blocks)} MoE layers, adapter pool {pool / 2**20:.0f} MiB, {len(paths)} adapters loaded")

    sides = {"base": Side("loramux base"), "mixed": Side("loramux 8 adapters")}
    if worker is not None:
        sides["vllm"] = Side("vLLM base")
    rows = {"base": [None] * args.batch, "mixed": names}

    def once(key: str, new_tokens: int):
        if key == "vllm":
            elapsed, out = worker.generate(prompts, [None] * args.batch, new_tokens)
            decode = None
        else:
            elapsed, decode, out = loramux_generate(engine, prompts, rows[key], new_tokens)
        counts = [len(o) for o in out]
        if counts != [new_tokens] * args.batch:
            raise RuntimeError(f"{key}: requests produced {counts} tokens, expected {new_tokens} each")
        tok_s = args.batch * new_tokens / elapsed
        dec = args.batch * (new_tokens - 1) / decode if decode else None
        return tok_s, dec, out

    try:
        for key in list(sides):
            try:
                tok_s, _, _ = once(key, args.warmup_tokens)
            except RuntimeError as exc:  # vLLM took the model but cannot run it: say why, go on without it
                if key != "vllm":
                    raise
                vllm_note = f"vLLM unavailable: {exc}"
                log(vllm_note)
                del sides[key]
                worker.close()
                worker = None
                continue
            log(f"warm-up {sides[key].name:20s} {tok_s:8.2f} tok/s")
        order = list(sides)
        for r in range(args.rounds):
            for key in (order if r % 2 == 0 else order[::-1]):
                capture.on = key == "base" and r == 0
                tok_s, dec, out = once(key, args.new_tokens)
                capture.on = False
                side = sides[key]
                side.tok_s.append(tok_s)
                if dec:
                    side.decode_tok_s.append(dec)
                if r == 0:
                    side.ids = out
                log(f"round {r + 1}/{args.rounds} {side.name:20s} {tok_s:8.2f} tok/s"
                    + (f" (decode only {dec:.2f})" if dec else ""))
    finally:
        if worker is not None:
            worker.close()
    capture.remove()

    log("one MoE block at batch 8: grouped vs dense, on the captured decode steps")
    # The engine's experts are packed for oneDNN (their float stacks are gone): the dense baseline runs on an
    # unpacked copy of the same weights, as one batched matmul over every expert.
    unpacked = load_unpacked(model_dir, args.dtype)
    dense = grouped_vs_dense(blocks, moe_blocks(unpacked), capture.inputs, args.dense_reps)
    del unpacked
    if args.profile:
        profile_steps(engine, prompts, names, steps=4)

    # --- report ---
    med = {k: statistics.median(s.tok_s) for k, s in sides.items()}
    print(f"\nMoE stack: qwen3_moe at {'toy shapes (--tiny)' if args.tiny else 'Qwen3-30B-A3B layer shapes'}, "
          f"{cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, {num_experts(cfg)} experts top-"
          f"{cfg['num_experts_per_tok']}, width {cfg['moe_intermediate_size']}, vocab {cfg['vocab_size']} "
          f"(the layer stack dominates), {args.dtype}; batch {args.batch}, {PROMPT_LEN}-token prompts, "
          f"{args.new_tokens} new tokens (EOS ignored), {args.rounds} round(s) after one warm-up; "
          f"{time.strftime('%Y-%m-%d %H:%M')} UTC")
    print(f"{'configuration':24s}{'tok/s (median)':>16s}{'decode-only tok/s':>19s}   rounds")
    for key, side in sides.items():
        dec = f"{statistics.median(side.decode_tok_s):19.2f}" if side.decode_tok_s else f"{'':19s}"
        print(f"{side.name:24s}{med[key]:16.2f}{dec}   {[round(v, 2) for v in side.tok_s]}")

    pairs = args.batch * cfg["num_experts_per_tok"]
    base_b, lora_b = step_bytes(cfg, elem, dense.distinct, pairs)
    ceiling = base_b / (base_b + lora_b)
    mixed_ratio = med["mixed"] / med["base"]
    print(f"\nexpert LoRA: {args.batch} distinct adapters, r={RANK}, one per row; bytes a decode step reads "
          f"({args.dtype}): base {base_b / 2**20:.1f} MiB (mean {statistics.mean(dense.distinct):.1f} distinct "
          f"experts per layer x {3 * cfg['hidden_size'] * cfg['moe_intermediate_size'] * elem / 2**20:.2f} MiB, "
          f"plus attention, router, LM head), LoRA {lora_b / 2**20:.1f} MiB ({pairs} (row, expert) pairs per layer)"
          f" -> ceiling base / (base + LoRA) = {ceiling:.3f}; measured mixed / base {mixed_ratio:.3f} "
          f"({mixed_ratio / ceiling:.0%} of the ceiling)")
    differ = sum(a != b for a, b in zip(sides["base"].ids, sides["mixed"].ids))
    print(f"rows whose greedy output the adapters changed (first round): {differ}/{args.batch}")

    ratios = [d / g for d, g in zip(dense.dense_ms, dense.grouped_ms)]
    implied = [dense.num_experts / d for d in dense.distinct]
    overall = sum(dense.dense_ms) / sum(dense.grouped_ms)
    overall_implied = dense.num_experts / statistics.mean(dense.distinct)
    print(f"\ngrouped vs dense, one MoE block at batch {args.batch} ({len(capture.inputs[0])} captured decode steps "
          f"per layer x {args.dense_reps} timings, medians; outputs agree to {dense.max_diff:.2e}):")
    print(f"{'layer':>6s}{'grouped ms':>12s}{'dense ms':>10s}{'dense/grouped':>15s}{'distinct':>10s}"
          f"{'E/distinct':>12s}")
    for i, (gm, dm, r, d, f) in enumerate(zip(dense.grouped_ms, dense.dense_ms, ratios, dense.distinct, implied)):
        print(f"{i:6d}{gm:12.2f}{dm:10.2f}{r:15.2f}{d:10.1f}{f:12.2f}")
    print(f"{'all':>6s}{sum(dense.grouped_ms):12.2f}{sum(dense.dense_ms):10.2f}{overall:15.2f}"
          f"{statistics.mean(dense.distinct):10.1f}{overall_implied:12.2f}   (routing implies {overall_implied:.2f}x)")

    vllm_ratio = None
    if "vllm" in sides:
        from vs_vllm import agreement

        vllm_ratio = med["base"] / med["vllm"]
        print(f"\nloramux base / vLLM base: {vllm_ratio:.3f}; greedy outputs (first round, {args.dtype}): "
              f"{agreement(sides['base'].ids, sides['vllm'].ids)}")
    elif vllm_note:
        print(f"\n{vllm_note}")
    print(f"total runtime {time.perf_counter() - T0:.0f} s")
    print(describe_cpu())
    print(f"{args.threads} threads per engine on cores {cpus}")
    if vllm_ratio is None:  # before the FIGURE lines, which end the output
        print(f"NOTE moe_base_vs_vllm n/a: {(vllm_note or '').splitlines()[0]}")
    print(f"FIGURE moe_mixed_vs_base {mixed_ratio:.3f}")
    print(f"FIGURE moe_base_vs_vllm {'n/a' if vllm_ratio is None else f'{vllm_ratio:.3f}'}")
    print(f"FIGURE moe_grouped_vs_dense {overall:.2f}")
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--vllm-worker"]:
        return vllm_worker_main(json.loads(argv[1]))
    args = parse_args(argv)
    return run(args, pin_threads(args, "mixture of experts bench"))


def pin_threads(args, title: str) -> list[int]:
    """Pin this process to the first `args.threads` allowed cores with as many torch threads, print the bench's
    title, date and CPU, and return the cores."""
    import torch

    from loramux.testing import describe_cpu

    allowed = sorted(os.sched_getaffinity(0))
    cpus = allowed[:args.threads]
    if len(cpus) < args.threads:
        raise SystemExit(f"--threads {args.threads}: only cores {allowed} are allowed")
    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(args.threads)
    print(f"{title}{' (smoke)' if args.smoke else ''}: {time.strftime('%Y-%m-%d %H:%M')} UTC")
    print(describe_cpu())
    return cpus


if __name__ == "__main__":
    sys.exit(main())
