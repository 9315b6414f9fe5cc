"""A merge worker process: `python -m loramux.adapters.composition.merge_worker`, started by `merge.MergePool`, one
per merge.

Frames on stdin/stdout (`loramux.engine.structured.compile_pool.write_frame`: a kind byte, a length, the payload):
in, one `J`: a pickled job {"method", "params", "components": [(label, packed blob, digest, weight)], "base"
(ModelConfig), "memory_bytes", "cpu_s"}, read first, before the slow imports, so the pool's write never waits
on them; out, one of `O` + pickled (config bytes, safetensors bytes, rank), `X` + why (out of memory), `E` +
the pickled exception the merge raised. Everything crosses the pipes as bytes: no shared memory, no files.

Limits, set once torch and PEFT are imported (they are not the merge's): RLIMIT_AS = the address space then +
`memory_bytes`, so a merge that outgrows its estimate fails here and never in the serving process; RLIMIT_CPU
(soft) = the CPU time used + `cpu_s`, a backstop to the pool's kill. One torch thread, and the process dies with
its parent (PR_SET_PDEATHSIG): no orphan merge runs on.
"""
from __future__ import annotations

import pickle
import sys


def main() -> None:
    from loramux.engine.structured.compile_pool import read_frame_blocking, write_frame
    from loramux.engine.structured.compile_worker import _die_with_parent, _limit_cpu, _limit_memory

    _die_with_parent()
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    frame = read_frame_blocking(stdin)
    if frame is None or frame[0] != b"J":
        sys.exit(2)
    job = pickle.loads(frame[1])
    del frame
    import peft  # noqa: F401 - imported before the limits: its import is not the merge's
    import safetensors.torch  # noqa: F401
    import torch

    from loramux.adapters.composition.merge import MergeComponent, _merge_here
    from loramux.adapters.storage.blob import unpack

    torch.set_num_threads(1)
    _limit_memory(job["memory_bytes"])
    _limit_cpu(job["cpu_s"])
    try:
        components = [MergeComponent(label, unpack(blob, label, digest), weight)
                      for label, blob, digest, weight in job.pop("components")]
        merged = _merge_here(job["method"], job["params"], components, job["base"])
        del components
        out = b"O", pickle.dumps((merged.config, merged.weights, merged.rank), protocol=pickle.HIGHEST_PROTOCOL)
    except MemoryError:
        out = b"X", b"an allocation failed"
    except Exception as exc:  # noqa: BLE001 - every outcome goes back to the pool
        if "can't allocate memory" in str(exc) or "not enough memory" in str(exc).lower():  # torch's allocator
            out = b"X", str(exc).split("\n")[0][-200:].encode()
        else:
            try:
                out = b"E", pickle.dumps(exc)
            except Exception:  # noqa: BLE001 - an exception that does not pickle: its words
                out = b"E", pickle.dumps(RuntimeError(f"{type(exc).__name__}: {exc}"[:500]))
    write_frame(stdout, *out)


if __name__ == "__main__":
    main()
