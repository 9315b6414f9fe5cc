"""How well an engine replica can serve an adapter version now, from the snapshot it publishes (torch- and Ray-free).

The engine deployment's request router (`loramux.cluster.residency_router`) scores every candidate replica
for a request's adapter digest and prefers the highest score; replicas with equal scores (and every replica,
for a base-model request) are left to Serve's power of two choices by queue length. The levels:

* `DEVICE` 1.0: the version is on the replica's device, or being copied there ("loading"), or this router
  sent it a request for the version after the replica's last snapshot was taken (see `hinted_at`).
* `HOST` 0.7: it is in the replica's host RAM (a host -> device copy away: milliseconds).
* `FREE_SLOT` 0.6: the device pool has room for it without evicting anything (a download or disk read,
  then a copy; `free_device_bytes` >= the adapter's slot size when that is known, else any free bytes).
* `EVICTABLE` 0.3: the pool is full but holds an adapter no request is running on, which can make room.
* `NONE` 0.0: none of these, or nothing is known: no snapshot, a stale one, one that cannot be read.

A snapshot is the dict `EngineReplica.snapshot()` publishes: `residency` {digest: "device"|"loading"},
`host` [digest, ...], `free_device_bytes`, `evictable`, `at` (the replica's wall clock), and `stats` (the
engine's, whose `lora` section `device_room` reads when the snapshot predates `free_device_bytes` /
`evictable`; its `adapters` list, when the engine has one, also counts as device residency).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping

DEVICE, HOST, FREE_SLOT, EVICTABLE, NONE = 1.0, 0.7, 0.6, 0.3, 0.0


def device_room(lora: Mapping | None) -> tuple[int | None, int]:
    """(free device bytes, evictable adapters) from an engine's `stats()["lora"]`: free = budget - bytes placed
    (None when LoRA is off or the numbers are missing); evictable = device-resident adapters with no running
    request, counted from `adapters` ({"state": "resident"|"loading", "running": n, ...}) when the engine
    lists them, else `device_adapters` less the adapters with running requests (`running`: their names)."""
    if not isinstance(lora, Mapping) or not lora:
        return None, 0
    budget, used = lora.get("device_budget_bytes"), lora.get("device_bytes")
    free = max(0, budget - used) if _is_int(budget) and _is_int(used) else None
    adapters = lora.get("adapters")
    if isinstance(adapters, list):
        evictable = sum(1 for a in adapters if isinstance(a, Mapping) and a.get("state") == "resident"
                        and not a.get("running"))
    else:
        resident, running = lora.get("device_adapters"), lora.get("running")
        busy = len(running) if isinstance(running, list) else 0
        evictable = max(0, resident - busy) if _is_int(resident) else 0
    return free, evictable


def residency_score(digest: str, snapshot: Mapping | None, *, now: float, max_age_s: float,
                    slot_bytes: int | None = None, hinted_at: float | None = None, settle_s: float = 2.0,
                    serve_holds: bool = False) -> float:
    """The level (module docstring) of one replica for `digest`, given its latest `snapshot` (None: none).

    `now`: wall-clock time; a snapshot taken more than `max_age_s` before it is ignored (the replica may have
    changed since, or be gone). `slot_bytes`: the adapter's device slot size, if known. `hinted_at`: when this
    router last sent the replica a request for `digest` (None: never): until a snapshot taken `settle_s` after
    that omits the version, it counts as on its way to the device (snapshots lag requests by up to an
    interval, and a burst for a cold adapter would otherwise be spread over every replica with room).
    `serve_holds`: Serve's own multiplexing says the replica's loader holds the version (a host copy)."""
    fresh = snapshot if _fresh(snapshot, now, max_age_s) else None
    if hinted_at is not None and (fresh is None or hinted_at + settle_s > _at(fresh)):
        return DEVICE
    if fresh is None:
        return HOST if serve_holds else NONE
    if digest in _on_device(fresh):
        return DEVICE
    if serve_holds or digest in _strings(fresh.get("host")):
        return HOST
    free, evictable = _room(fresh)
    if free is not None and (free >= slot_bytes if _is_int(slot_bytes) and slot_bytes > 0 else free > 0):
        return FREE_SLOT
    if evictable > 0:
        return EVICTABLE
    return NONE


def rank(scores: Mapping[str, float]) -> list[list[str]]:
    """Replica ids grouped by score, best group first (ids in each group in the order given)."""
    groups: dict[float, list[str]] = {}
    for replica_id, score in scores.items():
        groups.setdefault(score, []).append(replica_id)
    return [groups[score] for score in sorted(groups, reverse=True)]


# -- reading a snapshot (anything it lacks, or holds in the wrong shape, counts as absent) ----------------
def _fresh(snapshot: Mapping | None, now: float, max_age_s: float) -> bool:
    return isinstance(snapshot, Mapping) and _is_number(snapshot.get("at")) and now - snapshot["at"] <= max_age_s


def _at(snapshot: Mapping) -> float:
    return float(snapshot["at"])


def _on_device(snapshot: Mapping) -> set[str]:
    residency = snapshot.get("residency")
    held = {d for d, where in residency.items() if where in ("device", "loading")} \
        if isinstance(residency, Mapping) else set()
    stats = snapshot.get("stats")
    lora = stats.get("lora") if isinstance(stats, Mapping) else None
    adapters = lora.get("adapters") if isinstance(lora, Mapping) else None
    if isinstance(adapters, list):
        held |= {a["digest"] for a in adapters if isinstance(a, Mapping) and isinstance(a.get("digest"), str)
                 and a.get("state") in ("resident", "loading")}
    return held


def _room(snapshot: Mapping) -> tuple[int | None, int]:
    free, evictable = snapshot.get("free_device_bytes"), snapshot.get("evictable")
    if "free_device_bytes" in snapshot and (free is None or _is_int(free)) and _is_int(evictable):
        return free, evictable
    stats = snapshot.get("stats")
    return device_room(stats.get("lora") if isinstance(stats, Mapping) else None)


def _strings(values: Iterable | None) -> set[str]:
    return {v for v in values if isinstance(v, str)} if isinstance(values, (list, tuple, set, frozenset)) else set()


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
