"""A grammar-compile worker process: `python -m loramux.engine.structured.compile_worker`, started by `CompilePool`.

xgrammar compiles in C++ and cannot be interrupted, so a compile that must be stoppable runs here, in a
process the pool kills on timeout. Frames on stdin/stdout (see `compile_pool.write_frame`):
1. in: `I` {"tokenizer_info": xgrammar TokenizerInfo JSON, "memory_bytes", "cpu_s"}; out: `R` (ready).
2. per compile, in: `C` {"method": one of METHODS, "args": {...}}; out: `O` + the CompiledGrammar's
   serialize_json text, `E` + xgrammar's error message (a bad spec), or `X` + why (out of memory).

Limits, set once the imports are done (they are not the compile's): RLIMIT_AS = the address space then +
`memory_bytes`, so a blow-up fails this process and never the engine's; RLIMIT_CPU (soft) = the CPU time
used so far + `cpu_s` before each compile, a backstop that ends the process even if the pool cannot.
The worker also dies with its parent (PR_SET_PDEATHSIG), so no orphan compiles on.
"""
from __future__ import annotations

import json
import resource
import sys

METHODS = ("compile_json_schema", "compile_regex", "compile_grammar")


def main() -> None:
    from loramux.engine.structured.compile_pool import read_frame_blocking, write_frame

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    frame = read_frame_blocking(stdin)  # read before the slow imports, so the parent's write never waits
    if frame is None or frame[0] != b"I":
        sys.exit(2)
    init = json.loads(frame[1])
    _die_with_parent()
    import xgrammar

    info = xgrammar.TokenizerInfo.deserialize_json(init["tokenizer_info"])
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    del init["tokenizer_info"], frame
    _limit_memory(init["memory_bytes"])
    write_frame(stdout, b"R", b"")
    while True:
        frame = read_frame_blocking(stdin)
        if frame is None:  # the pool closed the pipe: shut down
            return
        job = json.loads(frame[1])
        if job["method"] not in METHODS:
            write_frame(stdout, b"E", b"unknown compile method")
            continue
        _limit_cpu(init["cpu_s"])
        try:
            compiled = getattr(compiler, job["method"])(**job["args"])
            text = compiled.serialize_json()
        except MemoryError:
            write_frame(stdout, b"X", b"the compile ran out of memory")
            continue
        except RuntimeError as exc:  # xgrammar's report of a bad spec
            message = str(exc)
            status = b"X" if "bad_alloc" in message else b"E"
            write_frame(stdout, status, message.encode())
            continue
        write_frame(stdout, b"O", text.encode())


def _limit_memory(extra_bytes: int) -> None:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[0])
    limit = pages * resource.getpagesize() + extra_bytes
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _limit_cpu(seconds: float) -> None:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    used = usage.ru_utime + usage.ru_stime
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    resource.setrlimit(resource.RLIMIT_CPU, (int(used + seconds) + 1, hard))  # SIGXCPU ends the process


def _die_with_parent() -> None:
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux/glibc: the pool's kill and RLIMIT_CPU still bound it
        pass


if __name__ == "__main__":
    main()
