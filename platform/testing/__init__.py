"""Support for loramux's tests and benchmark scripts, shipped with the package (as `torch.testing` is).

One place for what tests and benches share: free ports, the percentile every figure uses, the CPU
description every bench prints, a live uvicorn server in a thread, redis-server / moto launchers, a TCP
fault proxy, random PEFT adapters and tiny random checkpoints. Importing it needs only loramux's own
dependencies: moto, redis, boto3 and uvicorn are imported inside the functions that use them. Nothing in
loramux itself imports this package.
"""
from __future__ import annotations

from loramux.testing.checkpoints import PROJECTIONS, save_tiny_hf_model, save_tiny_multimodal_model, write_peft_adapter
from loramux.testing.faults import FaultyProxy
from loramux.testing.live_server import LiveServer
from loramux.testing.machine import CpuInfo, cpu_info, describe_cpu
from loramux.testing.ports import free_port, wait_for_port
from loramux.testing.services import (
    MOTO_CREDENTIALS,
    MOTO_REGION,
    RedisServer,
    moto_create_bucket,
    start_moto_process,
    start_moto_server,
    start_redis_server,
    stop_moto_server,
)
from loramux.testing.stats import median_seconds, percentile

__all__ = [
    "PROJECTIONS", "save_tiny_hf_model", "save_tiny_multimodal_model", "write_peft_adapter",
    "FaultyProxy", "LiveServer", "CpuInfo", "cpu_info",
    "describe_cpu", "free_port", "wait_for_port", "MOTO_CREDENTIALS", "MOTO_REGION", "RedisServer",
    "moto_create_bucket", "start_moto_process", "start_moto_server", "start_redis_server", "stop_moto_server",
    "median_seconds", "percentile",
]
