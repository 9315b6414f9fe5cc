"""Throwaway backing services for tests and benches: a private redis-server and moto's S3 server.

moto, boto3 and redis are imported inside the functions: `loramux.testing` imports without them."""
from __future__ import annotations

import subprocess
import time
from typing import NamedTuple

from loramux.child_python import python_command
from loramux.testing.ports import free_port, wait_for_port

# moto accepts any credentials; these dummies go to each client explicitly (the environment is left alone).
MOTO_CREDENTIALS = {"access_key_id": "testing", "secret_access_key": "testing"}
MOTO_REGION = "us-east-1"


class RedisServer(NamedTuple):
    """A private redis-server (unpacks as `url, process, port`); the caller stops its process."""

    url: str  # redis://127.0.0.1:<port>/0
    process: subprocess.Popen
    port: int


def start_redis_server(binary: str, timeout_s: float = 20.0) -> RedisServer:
    """Start `binary` (redis-server) on a free port with nothing on disk; return once it answers PING
    (RuntimeError if it exits or does not answer within `timeout_s`)."""
    import redis

    port = free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url, socket_timeout=1)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            client.ping()
            return RedisServer(url, proc, port)
        except redis.ConnectionError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError("redis-server did not start") from None
            time.sleep(0.05)  # polling a real condition: the server accepting connections


def start_moto_server(port: int = 0):
    """An S3-compatible moto server in this process (a ThreadedMotoServer, started) on 127.0.0.1:`port`
    (0: a free one); its endpoint is `http://127.0.0.1:{server.get_host_and_port()[1]}`. Stop it with
    stop_moto_server."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    return server


def stop_moto_server(server) -> None:
    """Stop a ThreadedMotoServer and close its listening socket (`stop()` only ends serve_forever,
    which leaves the port accepting connections that nobody answers)."""
    server.stop()
    if getattr(server, "_server", None) is not None:
        server._server.server_close()


def start_moto_process() -> tuple[subprocess.Popen, str]:
    """moto's S3 server in a subprocess (a remote service does not share the caller's GIL, which a bench
    measuring latency needs); (process, endpoint URL) once it accepts connections. The caller terminates it."""
    port = free_port()
    proc = subprocess.Popen(python_command("-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for_port(port)
    return proc, f"http://127.0.0.1:{port}"


def moto_create_bucket(endpoint_url: str, bucket: str) -> None:
    """Create `bucket` on the moto server at `endpoint_url`, with the dummy credentials."""
    import boto3

    client = boto3.session.Session().client(
        "s3", endpoint_url=endpoint_url, region_name=MOTO_REGION,
        aws_access_key_id=MOTO_CREDENTIALS["access_key_id"],
        aws_secret_access_key=MOTO_CREDENTIALS["secret_access_key"])
    client.create_bucket(Bucket=bucket)
