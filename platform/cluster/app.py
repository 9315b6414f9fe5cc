"""The Ray Serve application: one ingress deployment (the FastAPI app) and one engine deployment whose
replicas each run an engine (one per GPU on a GPU cluster).

Requests reach engine replicas through a DeploymentHandle with `multiplexed_model_id` = the adapter
version's digest, and the engine deployment routes them by where that adapter really is
(`loramux.cluster.residency_router.ResidencyRouter`, Serve's `request_router_config`): each replica publishes
a snapshot to Redis every `cluster_snapshot_interval_s` (its device pool's adapters, the versions in its host
RAM, its free device bytes and evictable adapters), and the router, in the ingress's process, scores every
replica for the request's digest: on the device (or being copied there) 1.0, in host RAM 0.7, a free device
slot that fits it 0.6, an adapter it can evict 0.3, else 0 (`loramux.cluster.residency_score`). The best
scored replicas are tried first, by Serve's power of two choices on queue length among equals; lower ones
only when those are full. So a cold adapter is placed on one replica with room (the router remembers where
it sent it until the snapshots catch up) rather than on all of them. Serve's own multiplexed loader keeps
`ray_adapters_per_replica` host copies per replica (least recently used out), which count as host residency.
Base-model requests carry no id and go to the less loaded of two replicas.

`run(settings)` is what `loramux serve --ray` calls; `build_app(settings)` is the application for
`serve.run` or a Serve config (`loramux.cluster.app:app_builder`).
"""
from __future__ import annotations

import logging

from ray import serve
from ray.serve.config import RequestRouterConfig

from loramux.cluster.deployment_settings import public_fields, replica_settings, runtime_env
from loramux.cluster.residency_router import router_kwargs
from loramux.settings import Settings

log = logging.getLogger(__name__)

APP_NAME = "loramux"
ENGINE_DEPLOYMENT = "engine"
ROUTER_CLASS = "loramux.cluster.residency_router.ResidencyRouter"  # imported by Serve where a handle routes


def _engine_deployment(settings: Settings):
    gpus = 1 if settings.device in ("cuda", "auto") and _cuda_visible() else 0

    @serve.deployment(name=ENGINE_DEPLOYMENT, num_replicas=settings.ray_replicas,
                      ray_actor_options={"num_cpus": 1 if gpus else 0.5, "num_gpus": gpus,
                                         "runtime_env": runtime_env(settings)},  # secrets: never arguments
                      max_ongoing_requests=max(2 * settings.max_num_seqs, 8), health_check_period_s=2,
                      health_check_timeout_s=10, graceful_shutdown_timeout_s=5,
                      request_router_config=RequestRouterConfig(
                          request_router_class=ROUTER_CLASS,
                          request_router_kwargs=router_kwargs(settings.cluster_snapshot_interval_s,
                                                              settings.redis_timeout_s)))
    class Engine:
        def __init__(self, public: dict):
            from loramux.cluster.replica import EngineReplica

            context = serve.get_replica_context()
            self.core = EngineReplica(replica_settings(public), context.replica_id.unique_id)

        @serve.multiplexed(max_num_models_per_replica=settings.ray_adapters_per_replica)
        async def adapter(self, digest: str):
            return await self.core.load_adapter(digest)

        async def generate(self, payload: dict):
            adapter = None
            if payload["version"] is not None:
                self.core.remember(payload["version"])
                adapter = await self.adapter(serve.get_multiplexed_model_id())
            async for message in self.core.generate(payload, adapter):
                yield message

        def info(self) -> dict:
            return self.core.info()

        def offload_adapter(self, digest: str) -> dict:
            return self.core.offload(digest)

        async def warm_host(self, version) -> dict:
            """Operator / test hook: the version (an AdapterVersionInfo) into the host RAM of the replica this
            call reaches, bypassing Serve's multiplexed loader (`EngineReplica.warm_host`); {"replica": its id}.
            A call with no `multiplexed_model_id` goes to either replica (the shorter queue of two)."""
            return await self.core.warm_host(version)

        def check_health(self) -> None:
            self.core.check_health()  # raises once the engine loop died: Serve replaces this replica

        def __del__(self):
            core = getattr(self, "core", None)
            if core is not None:
                core.shutdown()

    return Engine


def _ingress_deployment(settings: Settings):
    public = public_fields(settings)  # what the builder closes over is shipped with it: no secrets

    def build_asgi():
        from loramux.cluster.ingress_services import ingress_services
        from loramux.server.app import create_app
        from loramux.tenancy.shared_rate_limits import SharedRateLimiter

        handle = serve.get_deployment_handle(ENGINE_DEPLOYMENT, app_name=APP_NAME)
        own = replica_settings(public)
        ingress_id = serve.get_replica_context().replica_id.unique_id
        return create_app(lambda: ingress_services(own, handle, ingress_id),
                          limiter_factory=lambda: SharedRateLimiter(
                              own.redis_url, timeout_s=own.redis_timeout_s, cooldown_s=own.redis_cooldown_s,
                              fail_mode=own.shared_limits_fail_mode))

    # The builder runs on the replica; binding the engine deployment to it deploys both as one application.
    return serve.deployment(serve.ingress(build_asgi)(), name="ingress", num_replicas=1,
                            ray_actor_options={"num_cpus": 0, "runtime_env": runtime_env(settings)},
                            max_ongoing_requests=1000)


def build_app(settings: Settings) -> serve.Application:
    if not settings.redis_url:
        raise ValueError("LORAMUX_REDIS_URL is required with Ray: replicas share rate limits and state through it")
    engine = _engine_deployment(settings).bind(public_fields(settings))
    return _ingress_deployment(settings).bind(engine)


def app_builder(args: dict) -> serve.Application:
    """For `serve run loramux.cluster.app:app_builder key=value ...` (Settings fields; env LORAMUX_* too)."""
    return build_app(Settings(**args))


def run(settings: Settings, blocking: bool = True) -> None:
    """Migrate once, start (or join) Ray and Serve, deploy, and serve HTTP on settings.host:port."""
    import ray

    from loramux.db import Database
    from loramux.tenancy.admin_keys import check_admin_key_format

    if settings.admin_key:
        check_admin_key_format(settings.admin_key)  # here, in one line, not in a replica's failing start
    Database(settings.resolved_database_url()).upgrade()  # once, here: never per replica
    if not ray.is_initialized():
        ray.init(address=settings.ray_address or None, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": settings.host, "port": settings.port})
    serve.run(build_app(settings), name=APP_NAME, route_prefix="/", blocking=blocking)


def _cuda_visible() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False
