"""KeyCache: answers are cached for their TTL, bounded in number, and never outlive an invalidate()."""
from __future__ import annotations

from loramux.tenancy.key_cache import KeyCache, hash_key


def test_answers_are_cached_and_invalidate_forgets_them():
    cache, calls = KeyCache(ttl_s=60), []
    load = lambda: calls.append(1) or "ctx"  # noqa: E731
    assert cache.get_or_load("d", load) == cache.get_or_load("d", load) == "ctx"
    assert len(calls) == 1
    cache.invalidate()
    cache.get_or_load("d", load)
    assert len(calls) == 2


def test_a_lookup_racing_an_invalidate_does_not_store_its_stale_answer():
    """The key is revoked (invalidate) while a lookup that read it as valid is still on its way back:
    that answer may serve the request in flight, but must not be cached for later ones."""
    cache = KeyCache(ttl_s=60)
    answers = iter(["valid (read before the revocation)", None])

    def load_during_revocation():
        answer = next(answers)
        cache.invalidate()  # the revocation commits while this lookup is in flight
        return answer

    assert cache.get_or_load("d", load_during_revocation) == "valid (read before the revocation)"
    assert cache.get_or_load("d", lambda: next(answers)) is None  # looked up again, not served stale


def test_the_cache_is_bounded_and_keys_of_the_wrong_form_never_look_up():
    cache, looked_up = KeyCache(ttl_s=60, max_entries=100), []
    for i in range(1_000):
        cache.get_or_load(str(i), lambda: None)
    assert len(cache._entries) <= 100
    assert cache.authenticate("lmxa-admin", "lmx-", looked_up.append) is None
    assert cache.authenticate("lmx-" + "x" * 200, "lmx-", looked_up.append) is None
    assert looked_up == []
    assert cache.authenticate("lmx-ok", "lmx-", lambda digest: digest) == hash_key("lmx-ok")


def test_a_flood_of_unknown_keys_never_evicts_known_ones():
    """Unknown keys ("no such key" answers) have their own bounded side: filling it many times over clears
    only that side, so a real key keeps its cached answer and costs no lookup."""
    cache, loads = KeyCache(ttl_s=60), []
    assert cache.get_or_load("real", lambda: loads.append("real") or "ctx") == "ctx"
    for i in range(3 * 10_000):
        cache.get_or_load(f"random-{i}", lambda: None)
    assert len(cache._negative) <= cache.max_negative
    assert cache.get_or_load("real", lambda: loads.append("real") or "ctx") == "ctx"
    assert loads == ["real"]


def test_unknown_keys_are_cached_too_and_a_key_created_later_is_found_after_invalidate():
    cache, loads = KeyCache(ttl_s=60), []
    assert cache.get_or_load("d", lambda: loads.append(1)) is None
    assert cache.get_or_load("d", lambda: loads.append(2) or "new") is None  # the negative answer, cached
    cache.invalidate()  # what creating a key does
    assert cache.get_or_load("d", lambda: "new") == "new"
    assert loads == [1]
