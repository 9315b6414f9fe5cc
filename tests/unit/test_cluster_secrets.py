"""Ray Serve deployments get no secrets as arguments (Serve keeps and shows them): the admin key, S3 secret,
console secret, metrics key and the passwords in the database and Redis URLs go through each deployment's
runtime env instead, as the LORAMUX_* variables Settings reads. Checked on the built application, without
starting Ray."""
from __future__ import annotations

import pytest

pytest.importorskip("ray.serve")

from ray import cloudpickle  # noqa: E402

from loramux.cluster.app import build_app  # noqa: E402
from loramux.settings import Settings  # noqa: E402

SECRETS = {"admin_key": "lmxa-" + "A" * 40, "s3_secret_access_key": "s3-secret-0123456789",
           "console_secret": "console-secret-0123456789", "metrics_key": "metrics-secret-0123456789",
           "redis_url": "redis://:redis-password-0123@redis:6379/0",
           "database_url": "postgresql+psycopg://loramux:db-password-0123@db/loramux"}
NEEDLES = ("A" * 40, "s3-secret-0123456789", "console-secret-0123456789", "metrics-secret-0123456789",
           "redis-password-0123", "db-password-0123")


@pytest.fixture
def settings(tmp_path) -> Settings:
    return Settings(data_dir=tmp_path, ray_replicas=2, **SECRETS)


def deployments(app):
    """(deployment, its pickled class and arguments) for the ingress and the engine it is bound to."""
    ingress = app._bound_deployment
    engine = ingress.init_args[0]._bound_deployment
    return [(d, cloudpickle.dumps((d.func_or_class, d.init_args[1:] if d is ingress else d.init_args,
                                   d.init_kwargs))) for d in (ingress, engine)]


def test_no_secret_is_in_a_deployments_arguments_or_code(settings):
    for deployment, shipped in deployments(build_app(settings)):
        leaked = [n for n in NEEDLES if n.encode() in shipped]
        assert leaked == [], deployment.name


def test_the_secrets_reach_every_replica_through_its_runtime_env(settings, monkeypatch):
    from loramux.cluster.deployment_settings import public_fields, replica_settings

    for deployment, _ in deployments(build_app(settings)):
        env = deployment.ray_actor_options["runtime_env"]["env_vars"]
        assert env == {f"LORAMUX_{k.upper()}": v for k, v in SECRETS.items()}, deployment.name
        for name, value in env.items():  # what a replica process sees
            monkeypatch.setenv(name, value)
        rebuilt = replica_settings(public_fields(settings))
        assert rebuilt == settings
        for name in env:
            monkeypatch.delenv(name)
