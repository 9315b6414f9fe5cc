"""Scoring engine replicas for an adapter request from their published snapshots (loramux.cluster.residency_score):
each level, the fallbacks for snapshots that lack the newer fields, ties, and stale, missing or malformed ones."""
from __future__ import annotations

import pytest

from loramux.cluster.residency_score import (
    DEVICE,
    EVICTABLE,
    FREE_SLOT,
    HOST,
    NONE,
    device_room,
    rank,
    residency_score,
)

NOW = 1_000_000.0
D = "d" * 64


def snap(residency=None, host=(), free=0, evictable=0, at=NOW - 0.5, **extra) -> dict:
    return {"residency": residency or {}, "host": list(host), "free_device_bytes": free, "evictable": evictable,
            "at": at, "stats": {}, **extra}


def score(snapshot, **kw) -> float:
    return residency_score(D, snapshot, now=NOW, max_age_s=4.0, **kw)


@pytest.mark.parametrize(("snapshot", "want"), [
    (snap(residency={D: "device"}, host=[D], free=10**6, evictable=3), DEVICE),
    (snap(residency={D: "loading"}), DEVICE),  # being copied there: its requests run as soon as it lands
    (snap(residency={"other": "device"}, host=[D], free=10**6, evictable=3), HOST),
    (snap(host=["other"], free=4096, evictable=3), FREE_SLOT),
    (snap(free=0, evictable=1), EVICTABLE),
    (snap(free=0, evictable=0), NONE),
])
def test_each_level(snapshot, want):
    assert score(snapshot) == want


def test_levels_are_ordered_device_host_free_slot_evictable_none():
    assert DEVICE > HOST > FREE_SLOT > EVICTABLE > NONE == 0.0
    assert (DEVICE, HOST, FREE_SLOT, EVICTABLE) == (1.0, 0.7, 0.6, 0.3)


def test_a_free_slot_must_fit_the_adapter_when_its_size_is_known():
    roomy = snap(free=4096, evictable=1)
    assert score(roomy, slot_bytes=4096) == FREE_SLOT
    assert score(roomy, slot_bytes=4097) == EVICTABLE  # room only by evicting
    assert score(snap(free=4096), slot_bytes=8192) == NONE
    assert score(snap(free=1), slot_bytes=None) == FREE_SLOT  # size unknown: any free bytes count
    assert score(snap(free=None, evictable=1)) == EVICTABLE  # LoRA off / budget unknown: no free slot known


def test_serve_multiplexing_record_counts_as_host_residency():
    assert score(snap(free=0), serve_holds=True) == HOST
    assert score(snap(residency={D: "device"}), serve_holds=True) == DEVICE
    assert score(None, serve_holds=True) == HOST  # no snapshot: Serve's record still holds


def test_stale_missing_and_malformed_snapshots_score_none():
    assert score(snap(residency={D: "device"}, at=NOW - 4.5)) == NONE  # older than max_age_s
    assert score(snap(residency={D: "device"}, at=NOW - 4.0)) == DEVICE  # exactly max_age_s: still fresh
    assert score(None) == NONE
    assert score({}) == NONE  # no `at`: its age is unknown
    assert score({"at": "yesterday", "residency": {D: "device"}}) == NONE
    assert score({"at": True, "residency": {D: "device"}}) == NONE
    garbled = {"at": NOW, "residency": ["not", "a", "dict"], "host": "not a list", "free_device_bytes": "x",
               "evictable": None, "stats": {"lora": "not a dict"}}
    assert score(garbled) == NONE


def test_a_routed_request_counts_as_device_until_a_later_snapshot_settles_it():
    cold = snap(free=10**6, at=NOW - 0.5)
    assert score(cold) == FREE_SLOT
    # Sent there 0.2 s ago, after this snapshot: the adapter is on its way.
    assert score(cold, hinted_at=NOW - 0.2, settle_s=2.0) == DEVICE
    # Sent 3 s before the snapshot was taken (past settle_s), which does not show it: the snapshot wins.
    assert score(cold, hinted_at=NOW - 3.5, settle_s=2.0) == FREE_SLOT
    # ... which still scores a host copy as such.
    assert score(snap(host=[D], at=NOW - 0.5), hinted_at=NOW - 3.5, settle_s=2.0) == HOST
    # No fresh snapshot at all: the hint stands alone.
    assert score(None, hinted_at=NOW - 0.2) == DEVICE
    assert score(snap(at=NOW - 60), hinted_at=NOW - 0.2) == DEVICE


def test_snapshots_without_the_room_fields_fall_back_to_engine_stats():
    lora = {"device_budget_bytes": 10_000, "device_bytes": 6_000, "device_adapters": 3, "running": ["a"]}
    old = {"residency": {}, "at": NOW, "stats": {"lora": lora}}
    assert score(old) == FREE_SLOT
    assert score(old, slot_bytes=5_000) == EVICTABLE  # 4 000 free; 3 resident, 1 busy: 2 evictable
    full = {**old, "stats": {"lora": {**lora, "device_bytes": 10_000, "device_adapters": 1}}}
    assert score(full) == NONE  # the one resident adapter is running


def test_the_engines_adapter_list_counts_for_device_residency_and_evictable():
    lora = {"device_budget_bytes": 100, "device_bytes": 100, "device_adapters": 2, "running": [],
            "adapters": [{"name": "x@1", "digest": D, "rank": 8, "state": "resident", "running": 1, "waiting": 0},
                         {"name": "y@1", "digest": "e" * 64, "rank": 8, "state": "loading", "running": 0,
                          "waiting": 2}]}
    listed = {"at": NOW, "stats": {"lora": lora}}
    assert score(listed) == DEVICE  # not in `residency` (a version this replica was never sent) but listed
    assert residency_score("e" * 64, listed, now=NOW, max_age_s=4.0) == DEVICE  # loading counts
    assert residency_score("f" * 64, listed, now=NOW, max_age_s=4.0) == NONE  # running or loading: none evictable


@pytest.mark.parametrize(("lora", "want"), [
    (None, (None, 0)),
    ({}, (None, 0)),
    ({"device_budget_bytes": 100, "device_bytes": 30, "device_adapters": 2, "running": ["a"]}, (70, 1)),
    ({"device_budget_bytes": 100, "device_bytes": 130, "device_adapters": 1, "running": ["a", "b"]}, (0, 0)),
    ({"device_adapters": 2, "running": []}, (None, 2)),
    ({"device_budget_bytes": 100, "device_bytes": 100,
      "adapters": [{"state": "resident", "running": 0}, {"state": "resident", "running": 2},
                   {"state": "loading", "running": 0}, "junk"]}, (0, 1)),
])
def test_device_room(lora, want):
    assert device_room(lora) == want


def test_rank_groups_ties_best_first_keeping_the_given_order():
    assert rank({"a": FREE_SLOT, "b": DEVICE, "c": FREE_SLOT, "d": NONE}) == [["b"], ["a", "c"], ["d"]]
    assert rank({"a": NONE, "b": NONE}) == [["a", "b"]]  # all tied: one group, Serve's two choices decide
    assert rank({}) == []


def test_unknown_replicas_rank_below_known_ones_with_room():
    snapshots = {"r1": snap(host=[D]), "r2": snap(free=10**6)}
    scores = {rid: score(snapshots.get(rid)) for rid in ("r1", "r2", "new-replica")}
    assert rank(scores) == [["r1"], ["r2"], ["new-replica"]]
