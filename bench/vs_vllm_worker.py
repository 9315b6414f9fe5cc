"""vLLM side of bench/vs_vllm.py: one `vllm.LLM` built once, answering JSON commands (one a line) on stdin.

Runs with the bench-only venv's python (bench/vllm_peer.py), with cwd outside the repo (the repo's kernels/
would shadow PyPI's `kernels`) and VLLM_ENABLE_V1_MULTIPROCESSING=0, so the engine runs in this process and
nothing spins while the other engine measures. Argument: one JSON object (model, max_loras, max_lora_rank,
max_cpu_loras, max_num_seqs, max_model_len, prefix_caching).

The first line written is {"ready": ...}; then, per command:
  {"cmd": "generate", "prompts": [[ids]], "adapters": [name | null], "paths": {name: dir}, "max_tokens": 64}
    -> {"elapsed_s", "counts": [tokens per request], "token_ids": [[ids]]}   (greedy, EOS ignored)
  {"cmd": "quit"} -> exits.
Errors come back as {"error": "..."}. vLLM's own logs (and anything printed) go to stderr: the protocol keeps
the original stdout to itself.
"""
from __future__ import annotations

import glob
import importlib.util
import json
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]  # bench/ must shadow nothing


def _preload_libs() -> list[str]:
    """PyTorch's libgomp and vLLM's tcmalloc: vLLM's CPU platform puts them into LD_PRELOAD for the engine
    processes it spawns; in-process (no multiprocessing) they must be there before this process starts, or
    the OpenMP thread binding leaves one core doing the work
    (https://github.com/vllm-project/vllm/issues/27369)."""
    libs = []
    torch_spec, vllm_spec = importlib.util.find_spec("torch"), importlib.util.find_spec("vllm")
    if torch_spec and torch_spec.submodule_search_locations:
        torch_dir = list(torch_spec.submodule_search_locations)[0]
        site = os.path.dirname(torch_dir)
        gomp = sorted(glob.glob(os.path.join(site, "torch.libs", "libgomp*.so*"))
                      + glob.glob(os.path.join(torch_dir, "lib", "libgomp*.so*")))
        libs += gomp[:1]
    if vllm_spec and vllm_spec.submodule_search_locations:
        site = os.path.dirname(list(vllm_spec.submodule_search_locations)[0])
        tcmalloc = sorted(glob.glob(os.path.join(site, "vllm", "libs", "libtcmalloc_minimal*.so*"))
                          + glob.glob(os.path.join(site, "vllm", "libs", "libtcmalloc.so*")))
        libs = tcmalloc[:1] + libs
    return libs


def _reexec_with_preload() -> None:
    if os.environ.get("LORAMUX_VS_VLLM_PRELOADED"):
        return
    current = os.environ.get("LD_PRELOAD", "")
    extra = [lib for lib in _preload_libs()
             if not any(key in os.path.basename(lib) and key in current for key in ("libgomp", "libtcmalloc"))]
    env = {**os.environ, "LORAMUX_VS_VLLM_PRELOADED": "1"}
    if extra:
        env["LD_PRELOAD"] = ":".join(filter(None, [*extra, current]))
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


def main() -> int:
    _reexec_with_preload()
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # vLLM logs and stray prints go to stderr
    sys.stdout = sys.stderr

    def send(obj: dict) -> None:
        proto.write(json.dumps(obj) + "\n")
        proto.flush()

    cfg = json.loads(sys.argv[1])
    t0 = time.perf_counter()
    try:
        import torch
        import vllm
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.lora.request import LoRARequest

        llm = LLM(model=cfg["model"], tokenizer=cfg["model"], dtype="float32", enable_lora=True,
                  max_loras=cfg["max_loras"], max_lora_rank=cfg["max_lora_rank"], max_cpu_loras=cfg["max_cpu_loras"],
                  max_num_seqs=cfg["max_num_seqs"], max_model_len=cfg["max_model_len"],
                  enable_prefix_caching=cfg["prefix_caching"], seed=0)
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which says why vLLM is unavailable
        traceback.print_exc()
        send({"error": f"vLLM failed to start: {type(exc).__name__}: {exc}".splitlines()[0]})
        return 1
    sched = llm.llm_engine.vllm_config.scheduler_config
    comp = llm.llm_engine.vllm_config.compilation_config
    send({"ready": True, "startup_s": time.perf_counter() - t0, "vllm": vllm.__version__, "torch": torch.__version__,
          "max_num_batched_tokens": sched.max_num_batched_tokens, "max_num_seqs": sched.max_num_seqs,
          "compilation_mode": str(getattr(comp, "mode", "?")), "ld_preload": os.environ.get("LD_PRELOAD", ""),
          "omp_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "")})

    lora_ids: dict[str, int] = {}
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        if cmd.get("cmd") == "quit":
            break
        try:
            paths = cmd.get("paths", {})
            loras = []
            for name in cmd["adapters"]:
                if name is None:
                    loras.append(None)
                    continue
                lora_id = lora_ids.setdefault(name, len(lora_ids) + 1)
                loras.append(LoRARequest(name, lora_id, paths[name]))
            params = SamplingParams(temperature=0, max_tokens=cmd["max_tokens"], ignore_eos=True)
            prompts = [TokensPrompt(prompt_token_ids=ids) for ids in cmd["prompts"]]
            start = time.perf_counter()
            outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
            elapsed = time.perf_counter() - start
            token_ids = [list(o.outputs[0].token_ids) for o in outs]
            send({"elapsed_s": elapsed, "counts": [len(t) for t in token_ids], "token_ids": token_ids})
        except Exception as exc:  # noqa: BLE001 - the parent fails loudly with this message
            traceback.print_exc()
            send({"error": f"{type(exc).__name__}: {exc}"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
