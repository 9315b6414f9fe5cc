"""Settings for Ray Serve deployments, with the secrets kept out of their arguments.

Serve stores a deployment's arguments (and whatever its class closes over) in its config and shows them
in logs and the dashboard, so they carry the non-secret fields only. The secret ones (`SECRET_FIELDS`:
keys, the S3 secret, and the database and Redis URLs, which may hold passwords) travel as `LORAMUX_*`
variables in the deployment's Ray runtime env, where a replica's `Settings` reads them.
"""
from __future__ import annotations

from loramux.settings import Settings

SECRET_FIELDS: tuple[str, ...] = ("admin_key", "console_secret", "metrics_key", "s3_access_key_id",
                                  "s3_secret_access_key", "database_url", "redis_url")


def public_fields(settings: Settings) -> dict:
    """The fields a deployment may be given as arguments (JSON-ready): everything but the secrets."""
    return settings.model_dump(mode="json", exclude=set(SECRET_FIELDS))


def secret_env(settings: Settings) -> dict[str, str]:
    """The secrets as the environment variables `Settings` reads (unset fields left out)."""
    values = settings.model_dump(include=set(SECRET_FIELDS))
    return {f"LORAMUX_{name.upper()}": str(value) for name, value in values.items() if value}


def runtime_env(settings: Settings) -> dict:
    """The Ray runtime env for a deployment's actors: the secrets as environment variables."""
    return {"env_vars": secret_env(settings)}


def replica_settings(public: dict) -> Settings:
    """The full Settings on a replica: the public fields as given, the secrets from its environment."""
    return Settings(**public)


def secret_from_env(field: str) -> str:
    """One secret field as this process's environment carries it ("" if unset): for code that Serve starts
    without a Settings of its own, such as a deployment handle's request router in the ingress's process."""
    if field not in SECRET_FIELDS:
        raise ValueError(f"{field!r} is not one of the secret fields {SECRET_FIELDS}")
    return str(getattr(Settings(), field) or "")
