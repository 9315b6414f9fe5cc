"""The machine a figure was measured on: printed by every bench, because results differ between CPU classes
(AVX2 / AVX-512 / AMX, Intel / AMD) and with the load other jobs put on the machine."""
from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

SIMD_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16",
              "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")


@dataclass(frozen=True)
class CpuInfo:
    model: str  # "unknown CPU" when neither lscpu nor /proc/cpuinfo says
    logical_cpus: int
    flags: str  # space-separated, as lscpu prints them ("unknown" when unreadable)

    @property
    def simd(self) -> str:
        """The vector-extension flags that matter for the kernels, in SIMD_FLAGS order."""
        present = set(self.flags.split())
        return " ".join(f for f in SIMD_FLAGS if f in present) or "unknown"


def cpu_info() -> CpuInfo:
    """The CPU model name and flags from lscpu, else /proc/cpuinfo, and the logical CPU count."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    if not out:
        try:
            out = Path("/proc/cpuinfo").read_text().replace("model name", "Model name").replace("flags", "Flags")
        except OSError:
            out = ""
    info: dict[str, str] = {}
    for line in out.splitlines():
        key, _, value = line.partition(":")
        info.setdefault(key.strip(), value.strip())
    return CpuInfo(info.get("Model name", "unknown CPU"), os.cpu_count() or 1, info.get("Flags", "unknown"))


def describe_cpu() -> str:
    """Two lines every bench prints before its figures:
    `machine: <model>, <n> logical CPUs, SIMD <flags>; torch <version>; load average <1 5 15 min>` and
    `lscpu flags: <all flags>`."""
    cpu = cpu_info()
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = "not installed"
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return (f"machine: {cpu.model}, {cpu.logical_cpus} logical CPUs, SIMD {cpu.simd}; torch {torch_version}; "
            f"load average {load}\nlscpu flags: {cpu.flags}")
