"""What a scaled-out (Ray Serve) deployment does not serve, refused clearly at its ingress, without starting Ray:
the ingress's own Services (`loramux.cluster.ingress_services`) behind the real app, its engine handle a stub
that only answers `info` (nothing here reaches a replica).

- Medusa heads: the replicas run no registry heads yet, so an upload (admin API, `loramux admin medusa upload`,
  the service itself) is a 409 that stores nothing (no row, no blob); listing still works.
- Combining adapters per request (`adapters`): a 400 `unsupported_parameter` naming the deployment."""
from __future__ import annotations

import os
import subprocess

import pytest

pytest.importorskip("ray", reason="the ray extra is not installed (pip install 'loramux[ray]')")

import httpx  # noqa: E402
from test_medusa_registry import heads_dir, heads_files, heads_rows, medusa_keys, post_heads  # noqa: E402

from conftest import adapter_files, new_tenant_key  # noqa: E402
from loramux.child_python import python_command
from loramux.db import Database  # noqa: E402
from loramux.settings import Settings  # noqa: E402
from loramux.testing import LiveServer, save_tiny_hf_model, write_peft_adapter  # noqa: E402

ADMIN_KEY = "lmxa-ray-ingress-admin-key-0123456789abcdefghij"
NOT_SERVED = "not served on a scaled-out (Ray Serve) deployment"


class _Info:
    async def remote(self) -> dict:
        return {"max_model_len": 512}


class StubEngineHandle:
    """The engine deployment's DeploymentHandle as far as the ingress's start needs it."""

    info = _Info()


@pytest.fixture(scope="module")
def ingress(tmp_path_factory, tokenizer, tiny_cfg, redis_url):
    from loramux.cluster.ingress_services import ingress_services
    from loramux.server.app import create_app

    tmp = tmp_path_factory.mktemp("ray-ingress")
    model_dir = tmp / "model"
    save_tiny_hf_model(model_dir, vocab_size=len(tokenizer))
    tokenizer.save_pretrained(model_dir)  # the ingress tokenizes with the model dir's tokenizer
    settings = Settings(model=str(model_dir), data_dir=tmp / "data", redis_url=redis_url, admin_key=ADMIN_KEY,
                        max_upload_bytes=256 * 1024, auth_failures_per_min=0, json_logs=False)
    Database(settings.resolved_database_url()).upgrade()  # `loramux serve --ray` migrates before the ingress starts
    with LiveServer(create_app(lambda: ingress_services(settings, StubEngineHandle(), "ingress-test"))) as server:
        admin = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=60)
        yield server, admin, tmp
        admin.close()
        server.services.engine.directory.close()  # its Redis refresher, before the session's Redis goes


def test_medusa_heads_upload_is_a_409_that_stores_nothing(ingress, tiny_cfg):
    from loramux.services import medusa as ops

    server, admin, tmp = ingress
    services = server.services
    assert services.serves_medusa_heads is False
    directory = heads_dir(tmp / "heads", tiny_cfg.hidden_size)

    resp = post_heads(admin, heads_files(directory))
    assert resp.status_code == 409, resp.text
    assert NOT_SERVED in resp.json()["error"]["message"]
    # The service the admin API (and every other caller) goes through says the same.
    with pytest.raises(ops.MedusaNotServedError, match=r"scaled-out \(Ray Serve\)"):
        ops.upload_heads(services, {}, {name: directory / name for name in heads_files(directory)})
    # The CLI prints the answer and fails.
    env = {**os.environ, "LORAMUX_ADMIN_KEY": ADMIN_KEY, "PYTHONUNBUFFERED": "1"}
    cli = subprocess.run(python_command("-m", "loramux.cli", "admin", "--url", server.url, "medusa", "upload",
                                        str(directory)), capture_output=True, text=True, timeout=120, env=env)
    assert cli.returncode == 1 and "409" in cli.stderr and NOT_SERVED in cli.stderr, cli.stderr

    assert heads_rows(services.medusa) == 0 and medusa_keys(services.medusa) == []
    listed = admin.get("/admin/medusa", params={"include_deleted": "true"})
    assert listed.status_code == 200 and listed.json() == {"heads": []}


def test_combining_adapters_is_a_400_naming_the_deployment(ingress, tiny_cfg):
    server, _, tmp = ingress
    services = server.services
    key = new_tenant_key(services, "acme")
    acme = services.tenancy.tenant("acme")
    for i, name in enumerate(("tone", "legal")):
        path = write_peft_adapter(tmp / name, tiny_cfg, 4, ["q_proj", "v_proj"], seed=i)
        services.registry.register(acme.id, name, adapter_files(path))
    body = {"model": "base", "prompt": "Once upon a time", "max_tokens": 2,
            "adapters": [{"model": "tone", "weight": 0.5}, {"model": "legal", "weight": 0.5}]}
    resp = httpx.post(f"{server.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                      timeout=60)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["code"] == "unsupported_parameter" and error["param"] == "adapters"
    assert "not available on a scaled-out (Ray Serve) deployment" in error["message"]
