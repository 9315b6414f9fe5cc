"""GPU check for the LoRA kernels and mixed-adapter decode, in one run.

On a CUDA machine (real shapes, bf16):
  1. Triton shrink/expand vs the torch reference at Llama-7B shapes (hidden 4096, intermediate 11008),
     decode (one row per adapter) and prefill (long segments) layouts.
  2. Kernel timings (triton.testing.do_bench): achieved GB/s (bytes the op must move) against a copy
     bandwidth measured here, and LoRA-op time / base GEMM time for the same rows.
  3. The fixed-shape BGMV kernels (one row per program, per-token slot index: what CUDA graphs replay)
     vs the same reference, and their time next to the segment kernels' on the decode layout.
  4. Decode of a random-weight Llama-7B-shaped model, batch 32: tokens/s with 1 vs 32 distinct adapters
     (r=16 on all 7 projections), and base-only, each eagerly and replayed as CUDA graphs
     (loramux.engine.cuda_graphs), with the graph step's logits checked against the eager step's.
`--smoke` (or its older name `--tiny`) runs the same code at tiny shapes on CPU (Triton interpreter), so a test
keeps it working; there the "cuda graphs" runs take the same fixed-shape path eagerly (capture and replay need
CUDA).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

if "--smoke" in sys.argv or "--tiny" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from loramux.kernels import LoRABatch, lora_expand, lora_shrink  # noqa: E402
from loramux.kernels.bgmv import bgmv_shrink_expand  # noqa: E402
from loramux.kernels.ops import lora_shrink_expand  # noqa: E402
from loramux.kernels.torch_ops import lora_expand_reference, lora_shrink_reference  # noqa: E402
from loramux.testing import describe_cpu  # noqa: E402

LLAMA_7B = dict(model_type="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
                rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
TINY = dict(LLAMA_7B, vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def timer(device):
    """Median seconds of fn(): do_bench on CUDA, wall clock on CPU."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3

    # CPU means the smoke run under Triton's interpreter, whose timings mean nothing: one call, no warm-up.
    def once(fn) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    return once


def check_kernels(cfg, device, dtype, tiny: bool) -> None:
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    measure = timer(device)
    big = torch.empty(64 * 1024**2 if not tiny else 1024**2, dtype=torch.uint8, device=device)
    dst = torch.empty_like(big)
    copy_gbs = 2 * big.numel() / measure(lambda: dst.copy_(big)) / 1e9
    print(f"copy bandwidth {copy_gbs:.0f} GB/s")
    g = torch.Generator(device="cpu").manual_seed(0)
    layouts = {"decode 32 rows x 32 adapters": list(range(32)),
               "prefill 4 x 256-row segments": [s for s in range(4) for _ in range(256 if not tiny else 20)]}
    failures = 0
    for rank in (16, 64):
        for d_in, d_out, what in ((h, h, "q_proj"), (h, inter, "gate_proj"), (inter, h, "down_proj")):
            for name, slot_map in layouts.items():
                n_slots = max(slot_map) + 1
                x = torch.randn(len(slot_map), d_in, generator=g).to(device, dtype)
                a = (torch.randn(n_slots, rank, d_in, generator=g) / d_in**0.5).to(device, dtype)
                b = (torch.randn(n_slots, rank, d_out, generator=g) * 0.1).to(device, dtype).transpose(1, 2)
                scale = torch.rand(n_slots, generator=g).to(device)
                y = torch.randn(len(slot_map), d_out, generator=g).to(device, dtype)
                batch = LoRABatch.from_slot_map(slot_map, device)
                v = lora_shrink(x, a, batch, impl="triton")
                ref_v = lora_shrink_reference(x.cpu().float(), a.cpu().float(), batch.slot_map.cpu())
                y_out = y.clone()
                lora_expand(y_out, v, b, scale, batch, impl="triton")
                ref_y = lora_expand_reference(y.cpu().float(), v.cpu().float(), b.cpu().float(), scale.cpu(),
                                              batch.slot_map.cpu())
                tol = 1e-3 if dtype == torch.float32 else 3e-2
                err_v = ((v.cpu().double() - ref_v).abs().max() / ref_v.abs().max().clamp(min=1e-6)).item()
                err_y = ((y_out.cpu().double() - ref_y).abs().max() / ref_y.abs().max().clamp(min=1e-6)).item()
                ok = err_v < tol and err_y < tol
                failures += not ok
                shrink_s = measure(lambda x=x, a=a, batch=batch: lora_shrink(x, a, batch, impl="triton"))
                expand_s = measure(lambda y=y, v=v, b=b, scale=scale, batch=batch:
                                   lora_expand(y, v, b, scale, batch, impl="triton"))
                w = torch.randn(d_in, d_out, device=device, dtype=dtype)
                gemm_s = measure(lambda x=x, w=w: x @ w)
                esize = x.element_size()
                shrink_bytes = (x.numel() + n_slots * rank * d_in + v.numel()) * esize
                expand_bytes = (v.numel() + n_slots * rank * d_out + 2 * y.numel()) * esize
                print(f"r={rank:2d} {what:9s} {name:30s} {'ok ' if ok else 'BAD'} rel.err {max(err_v, err_y):.1e} | "
                      f"shrink {shrink_s * 1e6:7.1f} us {shrink_bytes / shrink_s / 1e9:6.0f} GB/s | "
                      f"expand {expand_s * 1e6:7.1f} us {expand_bytes / expand_s / 1e9:6.0f} GB/s | "
                      f"LoRA/base GEMM {(shrink_s + expand_s) / gemm_s:5.2f}")
    failures += check_bgmv(cfg, device, dtype, measure, g)
    print(f"kernel checks: {'all ok' if not failures else f'{failures} FAILED'}")


def check_bgmv(cfg, device, dtype, measure, g) -> int:
    """BGMV (fixed-shape) shrink+expand vs the float64 reference on the decode layout: 32 rows, 28 of them on
    distinct adapters, 4 without one; timed next to the segment kernels on the same rows. Returns failures."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    slot_map = [s if s % 8 != 7 else -1 for s in range(32)]
    slots = torch.tensor(slot_map, device=device)
    batch = LoRABatch.from_slot_map(slot_map, device)
    failures = 0
    for rank in (16, 64):
        for d_in, d_outs, what in ((h, [h, h, h], "qkv_proj"), (h, [inter] * 2, "gate_up"), (inter, [h], "down_proj")):
            n = len(d_outs)
            x = torch.randn(32, d_in, generator=g).to(device, dtype)
            a = (torch.randn(32, n * rank, d_in, generator=g) / d_in**0.5).to(device, dtype)
            bs = [(torch.randn(32, rank, d, generator=g) * 0.1).to(device, dtype).transpose(1, 2) for d in d_outs]
            offsets = [sum(d_outs[:i]) for i in range(n)]
            scale = torch.rand(32, generator=g).to(device)
            y = torch.randn(32, sum(d_outs), generator=g).to(device, dtype)
            ref = y.cpu().double()
            for i, (b, off) in enumerate(zip(bs, offsets)):
                v = lora_shrink_reference(x.cpu().float(), a[:, i * rank:(i + 1) * rank].cpu().float(), slots.cpu())
                ref = lora_expand_reference(ref, v, b.cpu().float(), scale.cpu(), slots.cpu(), off)
            out = y.clone()
            bgmv_shrink_expand(out, x, a, bs, offsets, scale, slots, impl="triton")
            err = ((out.cpu().double() - ref).abs().max() / ref.abs().max().clamp(min=1e-6)).item()
            ok = err < (1e-3 if dtype == torch.float32 else 3e-2)
            failures += not ok
            times = ""
            if device.type == "cuda":  # interpreter timings mean nothing
                bgmv_s = measure(lambda x=x, a=a, bs=bs, offsets=offsets, scale=scale, y=y:
                                 bgmv_shrink_expand(y, x, a, bs, offsets, scale, slots, impl="triton"))
                sgmv_s = measure(lambda x=x, a=a, bs=bs, offsets=offsets, scale=scale, y=y:
                                 lora_shrink_expand(y, x, a, bs, offsets, scale, batch, impl="triton"))
                times = f" | bgmv {bgmv_s * 1e6:7.1f} us | sgmv (segments) {sgmv_s * 1e6:7.1f} us"
            print(f"bgmv r={rank:2d} {what:9s} decode 32 rows x 28 adapters {'ok ' if ok else 'BAD'} "
                  f"rel.err {err:.1e}{times}")
    return failures


def decode_timing(cfg_dict, device, dtype, tiny: bool) -> None:
    from loramux.adapters.formats.peft import LoRAAdapter
    from loramux.adapters.residency.device_pool import BucketKey, DevicePool
    from loramux.engine.model_runner import ModelRunner
    from loramux.engine.sampling.params import SamplingParams
    from loramux.engine.scheduling.block_manager import BlockManager
    from loramux.engine.scheduling.scheduler import Scheduler
    from loramux.engine.sequence import Sequence
    from loramux.model.config import ModelConfig
    from loramux.model.llama import LORA_MODULES, LlamaModel

    cfg = ModelConfig.from_hf(cfg_dict)
    batch, rank, steps, prompt_len = (32, 16, 32, 128) if not tiny else (4, 4, 5, 8)
    with torch.device(device):
        model = LlamaModel(cfg, max_positions=1024)
    with torch.no_grad():
        for p in model.parameters():  # parameters only: the RoPE tables stay float32
            p.data = p.data.to(dtype).normal_(0, 0.02)
    model.eval()
    block_size = 16
    num_blocks = batch * (prompt_len + steps + 2 * block_size) // block_size
    pool = DevicePool(model, 1 << 62, dtype, device, async_loads=False)
    key = BucketKey(rank, tuple(p for p in LORA_MODULES if p in pool.shapes))
    pool.resize(key, batch, [])
    shapes = {"q_proj": (cfg.hidden_size, cfg.q_size), "k_proj": (cfg.hidden_size, cfg.kv_size),
              "v_proj": (cfg.hidden_size, cfg.kv_size), "o_proj": (cfg.q_size, cfg.hidden_size),
              "gate_proj": (cfg.hidden_size, cfg.intermediate_size),
              "up_proj": (cfg.hidden_size, cfg.intermediate_size),
              "down_proj": (cfg.intermediate_size, cfg.hidden_size)}
    for slot in range(batch):
        weights = {(layer, t): (torch.randn(rank, d_in, device=device) * 0.01,
                                torch.randn(d_out, rank, device=device) * 0.01)
                   for layer in range(cfg.num_layers) for t, (d_in, d_out) in shapes.items()}
        pool.load(key, lambda slot=slot: slot,
                  LoRAAdapter(f"a{slot}", rank, 2.0 * rank, False, tuple(shapes), weights, f"d{slot}")).result()

    class Preloaded:
        """Every adapter is already in its slot (loaded above): the scheduler admits at once."""

        def want(self, digest, waited_s=0.0):
            return True

        def ready(self, digest):
            return True

        def lease(self, digest):
            pass

        release = requeue = drop_waiting = lease

    results, first_logits = {}, {}
    graphs_label = "cuda graphs" if device.type == "cuda" else "static path (eager on CPU)"
    runs = [(label, distinct, graphs) for label, distinct in (("base only", 0), ("1 adapter", 1),
                                                               (f"{batch} adapters", batch))
            for graphs in (False, True)]
    for label, distinct, graphs in runs:
        runner = ModelRunner(model, num_blocks, block_size, dtype, device, pool.wrapper,
                             lambda digest: (key, int(digest[1:])))
        if graphs:  # capture on CUDA; on CPU the same fixed-shape buffers, run eagerly
            runner.use_decode_graphs(capture=device.type == "cuda", max_batch=batch)
        blocks = BlockManager(num_blocks, block_size)
        scheduler = Scheduler(blocks, batch, max(batch, batch * prompt_len), Preloaded())
        seqs = [Sequence(f"s{i}", list(range(1, prompt_len + 1)), SamplingParams(max_tokens=steps),
                         adapter=None if distinct == 0 else f"d{i % distinct}") for i in range(batch)]
        for seq in seqs:
            scheduler.add(seq)
        first = scheduler.schedule()
        runner.run(first)
        for seq in seqs:
            seq.output_token_ids.append(1)
        scheduler.complete(first)
        # One untimed decode step (it captures the graph), whose logits are compared across the two paths.
        step = greedy_decode_step(scheduler, runner)
        first_logits[label, graphs] = {seq.request_id: step.logits[row].cpu() for seq, row, _ in step.rows}
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps - 2):
            greedy_decode_step(scheduler, runner)
        if device.type == "cuda":
            torch.cuda.synchronize()
        results[label, graphs] = batch * (steps - 2) / (time.perf_counter() - t0)
        mode = graphs_label if graphs else "eager"
        print(f"decode batch {batch}, {label:12s}, {mode}: {results[label, graphs]:8.1f} tok/s")
        if graphs:
            dg = runner.graphs
            eager, static = first_logits[label, False], first_logits[label, True]
            err = max(((static[r] - eager[r]).abs().max() / eager[r].abs().max().clamp(min=1e-6)).item() for r in eager)
            ok = not dg.disabled and err < (1e-3 if dtype == torch.float32 else 5e-2)
            print(f"{graphs_label} vs eager, {label}: {'ok ' if ok else 'BAD'} first-step logits rel.err {err:.1e}; "
                  f"{dg.steps} steps from fixed-shape buffers, {dg.captures} graphs captured"
                  f"{', capture FAILED (see the log)' if dg.disabled else ''}")
    for graphs in (False, True):
        r = {label: results[label, graphs] for label, _, g in runs if g == graphs}
        print(f"decode ratio ({graphs_label if graphs else 'eager'}) {batch} adapters / 1 adapter: "
              f"{r[f'{batch} adapters'] / r['1 adapter']:.2f}; {batch} adapters / base: "
              f"{r[f'{batch} adapters'] / r['base only']:.2f}")
    print(f"{graphs_label} / eager, tok/s: " + ", ".join(
        f"{label} {results[label, True] / results[label, False]:.2f}" for label, _, g in runs if g))


def greedy_decode_step(scheduler, runner):
    b = scheduler.schedule()
    step = runner.run(b)
    next_ids = step.logits.argmax(-1).tolist()
    for (seq, _, _), tok in zip(step.rows, next_ids):
        seq.output_token_ids.append(tok)
    scheduler.complete(b)
    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", "--tiny", dest="tiny", action="store_true",
                    help="smoke run (what the tests run): tiny shapes on CPU (Triton interpreter)")
    args = ap.parse_args()
    if not args.tiny and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --smoke for the CPU smoke version")
    device = torch.device("cuda" if not args.tiny else "cpu")
    dtype = torch.bfloat16 if not args.tiny else torch.float32
    cfg = LLAMA_7B if not args.tiny else TINY
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (tiny)"
    print(f"gpu_check on {name}, {dtype}, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M')}")
    print(describe_cpu())
    check_kernels(cfg, device, dtype, args.tiny)
    decode_timing(cfg, device, dtype, args.tiny)


if __name__ == "__main__":
    main()
