"""A bounded pool of grammar-compile worker processes (`loramux.engine.structured.compile_worker`) that kills a compile
on timeout.

Why processes: xgrammar's compile releases the GIL but cannot be interrupted, and some small specs take
seconds (the regex `.{0,256}` compiles in ~8 s). In a thread, a timed-out compile runs on after its request
was refused, so a tenant sending a new pathological spec each time stacks up threads. Here each of
`workers` processes runs one compile at a time under RLIMIT_AS / RLIMIT_CPU and is killed (then
restarted) when its compile passes `timeout_s`: when a job's future resolves, the work it started has
really stopped. The result crosses as xgrammar's serialize_json text (~100 ms for a realistic schema on
top of its ~45 ms compile, paid once per distinct spec: the GrammarCache keeps the result).

Subprocesses, not multiprocessing: the worker is a plain `python -m` module, so nothing of the parent
(torch threads, an event loop, Ray's state) is forked or re-imported.
"""
from __future__ import annotations

import json
import os
import select
import struct
import subprocess
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass

from loramux.child_python import python_command

__all__ = ["CompileLimits", "CompilePool", "CompileBusy", "CompileTooComplex", "CompileRefused"]

_HEADER = struct.Struct("<cQ")  # frame kind (one byte) + payload length
_STARTUP_TIMEOUT_S = 120.0  # importing xgrammar (and torch) in a fresh process, on a loaded machine


@dataclass(frozen=True)
class CompileLimits:
    """How structured-output compiles are bounded (LORAMUX_STRUCTURED_COMPILE_*)."""

    timeout_s: float = 10.0  # wall clock of one compile; also the longest wait for a free, started worker
    workers: int = 2  # compiles that run at once (one process each)
    memory_bytes: int = 2 * 1024**3  # address space a compile may add to a worker's
    max_repetition: int = 4096  # largest {m,n} bound / maxLength / maxItems ... accepted before compiling
    max_compiled_bytes: int = 64 * 1024**2  # a serialized result larger than this is refused as too complex
    max_waiting: int = 256  # compiles queued for a worker beyond this are refused at once (busy)

    @classmethod
    def from_settings(cls, settings) -> CompileLimits:
        return cls(timeout_s=settings.structured_compile_timeout_s, workers=settings.structured_compile_workers,
                   memory_bytes=settings.structured_compile_memory_bytes,
                   max_repetition=settings.structured_max_repetition)


class CompileRefused(Exception):
    """xgrammar refused the spec; the message is xgrammar's (the caller cleans and labels it)."""


class CompileTooComplex(Exception):
    """The compile passed the time, memory or output-size limit and was stopped."""


class CompileBusy(RuntimeError):
    """No worker became free in time (or too many compiles wait): retry later. Nothing ran."""


@dataclass
class _Job:
    method: str
    args: dict
    future: Future
    submitted: float  # time.monotonic()


class CompilePool:
    def __init__(self, tokenizer_info_json: str, limits: CompileLimits):
        """Workers start on first use, each on its own manager thread; `tokenizer_info_json` is xgrammar's
        TokenizerInfo.serialize_json of the engine's vocabulary."""
        self.limits = limits
        self._init = json.dumps({"tokenizer_info": tokenizer_info_json, "memory_bytes": limits.memory_bytes,
                                 "cpu_s": limits.timeout_s + 1.0}).encode()
        self._jobs: deque[_Job] = deque()
        self._wake = threading.Condition()
        self._closed = False
        self._running = 0  # compiles in a worker right now (gauge)
        self._killed = 0  # compiles stopped for a limit (counter)
        self._ready_at: float | None = None  # when the first worker was up: waiting counts from then
        self._procs: list[subprocess.Popen | None] = [None] * limits.workers
        self._threads = [threading.Thread(target=self._manage, args=(i,), name=f"loramux-compile-{i}", daemon=True)
                         for i in range(limits.workers)]
        for t in self._threads:
            t.start()

    def submit(self, method: str, args: dict) -> Future:
        """Compile on a worker: the future's result is the serialized CompiledGrammar (str), or it raises
        CompileRefused, CompileTooComplex or CompileBusy. Resolves only once the compile has finished or its
        process is dead."""
        future: Future = Future()
        with self._wake:
            if self._closed:
                future.set_exception(CompileBusy("the compile pool is shut down"))
            elif len(self._jobs) >= self.limits.max_waiting:
                future.set_exception(CompileBusy(f"{len(self._jobs)} structured-output compiles are waiting"))
            else:
                self._jobs.append(_Job(method, args, future, time.monotonic()))
                self._wake.notify()
        return future

    def stats(self) -> dict[str, int]:
        """`compiles_running`, `compiles_waiting` (gauges) and `compiles_killed` (counter)."""
        with self._wake:
            return {"compiles_running": self._running, "compiles_waiting": len(self._jobs),
                    "compiles_killed": self._killed}

    def worker_pids(self) -> list[int]:
        """The live worker processes (for tests and diagnostics)."""
        return [p.pid for p in self._procs if p is not None and p.poll() is None]

    def shutdown(self) -> None:
        """Refuse queued jobs, stop the workers (a running compile is killed) and wait for the managers."""
        with self._wake:
            self._closed = True
            pending = list(self._jobs)
            self._jobs.clear()
            self._wake.notify_all()
        for job in pending:
            job.future.set_exception(CompileBusy("the compile pool is shut down"))
        for proc in self._procs:
            if proc is not None:
                kill_worker(proc)
        for t in self._threads:
            t.join(timeout=10)

    # -- manager threads ------------------------------------------------------------------------------
    def _manage(self, slot: int) -> None:
        while True:
            with self._wake:
                while not self._jobs and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
                job = self._jobs.popleft()
            if not job.future.set_running_or_notify_cancel():
                continue
            if self._waited_too_long(job):
                job.future.set_exception(CompileBusy(
                    f"no structured-output compile worker was free within {self.limits.timeout_s:g} s"))
                continue
            try:
                job.future.set_result(self._run(slot, job))
            except BaseException as exc:  # noqa: BLE001 - every outcome goes to the job's waiter
                job.future.set_exception(exc)

    def _waited_too_long(self, job: _Job) -> bool:
        """The job waited for a worker longer than the timeout, not counting the time before the first
        worker was up (a cold start of several seconds must not refuse a burst of ordinary specs)."""
        with self._wake:
            ready_at = self._ready_at
        return ready_at is not None and time.monotonic() - max(job.submitted, ready_at) > self.limits.timeout_s

    def _run(self, slot: int, job: _Job) -> str:
        proc = self._procs[slot]
        if proc is None or proc.poll() is not None:
            proc = self._procs[slot] = self._start()
        assert proc.stdin is not None and proc.stdout is not None  # started with pipes
        with self._wake:
            self._running += 1
        try:
            write_frame(proc.stdin, b"C", json.dumps({"method": job.method, "args": job.args}).encode())
            kind, payload = read_frame(proc.stdout.fileno(), time.monotonic() + self.limits.timeout_s,
                                       self.limits.max_compiled_bytes)
        except (TimeoutError, _FrameTooLarge, EOFError, OSError) as exc:
            self._procs[slot] = None
            kill_worker(proc)  # returns once the process is gone: its compile has stopped
            with self._wake:
                self._killed += 1
            raise CompileTooComplex(_why(exc, self.limits)) from None
        finally:
            with self._wake:
                self._running -= 1
        if kind == b"O":
            return payload.decode()
        if kind == b"X":
            raise CompileTooComplex(payload.decode(errors="replace"))
        raise CompileRefused(payload.decode(errors="replace"))

    def _start(self) -> subprocess.Popen:
        proc = subprocess.Popen(python_command("-m", "loramux.engine.structured.compile_worker"),
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True)
        assert proc.stdin is not None and proc.stdout is not None  # pipes (PIPE)
        try:
            write_frame(proc.stdin, b"I", self._init)
            kind, _ = read_frame(proc.stdout.fileno(), time.monotonic() + _STARTUP_TIMEOUT_S, 16)
            if kind != b"R":
                raise OSError("unexpected reply")
            with self._wake:
                self._ready_at = self._ready_at or time.monotonic()
        except (TimeoutError, _FrameTooLarge, EOFError, OSError) as exc:
            kill_worker(proc)
            raise RuntimeError(f"a structured-output compile worker failed to start ({type(exc).__name__})") from None
        return proc


class _FrameTooLarge(Exception):
    pass


def _why(exc: BaseException, limits: CompileLimits) -> str:
    if isinstance(exc, TimeoutError):
        return f"compiling took longer than {limits.timeout_s:g} s"
    if isinstance(exc, _FrameTooLarge):
        return f"the compiled grammar is larger than {limits.max_compiled_bytes} bytes"
    return "the compile exceeded its CPU or memory limit"


def kill_worker(proc: subprocess.Popen) -> None:
    """Kill the worker process if it runs and reap it (returns once it is gone); close its pipes."""
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    for pipe in (proc.stdin, proc.stdout):
        assert pipe is not None  # workers are started with both pipes
        try:
            pipe.close()
        except OSError:
            pass


# -- frames -------------------------------------------------------------------------------------------
def write_frame(stream, kind: bytes, payload: bytes) -> None:
    stream.write(_HEADER.pack(kind, len(payload)))
    stream.write(payload)
    stream.flush()


def read_frame_blocking(stream) -> tuple[bytes, bytes] | None:
    """The next frame of a blocking binary stream; None at its end."""
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    kind, size = _HEADER.unpack(header)
    return kind, stream.read(size)


def read_frame(fd: int, deadline: float, max_bytes: int) -> tuple[bytes, bytes]:
    """The next frame from file descriptor `fd` by `deadline` (time.monotonic()): TimeoutError after it,
    EOFError when the writer died, _FrameTooLarge past `max_bytes` of payload."""
    kind, size = _HEADER.unpack(_read_exact(fd, _HEADER.size, deadline))
    if size > max_bytes:
        raise _FrameTooLarge()
    return kind, _read_exact(fd, size, deadline)


def _read_exact(fd: int, size: int, deadline: float) -> bytes:
    chunks, left = [], size
    while left:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError()
        ready, _, _ = select.select([fd], [], [], remaining)
        if not ready:
            raise TimeoutError()
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise EOFError()
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
