"""The bounded TTL key -> engine table: expiry, LRU bound, payloads, engine removal."""

from __future__ import annotations

import pytest

from gateway.policies.affinity_table import AffinityTable


def test_entries_expire_and_renew() -> None:
    t = AffinityTable(ttl_s=10.0, max_entries=4)
    t.put("k", "a", 0.0)
    assert t.get("k", 9.9) == "a" and t.expires("k") == 10.0
    t.touch("k", 5.0)
    assert t.get("k", 14.9) == "a"
    assert t.get("k", 15.0) is None and len(t) == 0  # an expired lookup drops it
    t.put("short", "b", 0.0, ttl_s=1.0)
    assert t.get("short", 1.0) is None


def test_the_least_recently_written_entry_goes_first() -> None:
    t = AffinityTable(ttl_s=10.0, max_entries=2)
    for k in ("x", "y", "z"):
        t.put(k, "a", 0.0)
    assert len(t) == 2 and t.get("x", 0.0) is None and t.get("z", 0.0) == "a"


def test_a_payload_rides_with_its_binding() -> None:
    t = AffinityTable(ttl_s=10.0, max_entries=4)
    t.put("k", "a", 0.0, payload=(3, 99))
    assert t.entry("k", 1.0) == ("a", (3, 99))
    t.touch("k", 2.0)  # a renewal keeps it
    assert t.entry("k", 11.0) == ("a", (3, 99))
    t.put("k", "b", 3.0)  # a new binding replaces it
    assert t.entry("k", 3.0) == ("b", None)
    assert t.entry("k", 13.0) is None


def test_removing_an_engine_forgets_its_bindings() -> None:
    t = AffinityTable(ttl_s=10.0, max_entries=8)
    for i, e in enumerate("abab"):
        t.put(f"k{i}", e, 0.0)
    assert t.drop_engine("a") == 2 and [k for k, _, _ in t.items(0.0)] == ["k1", "k3"]
    assert t.pop("k1") == "b" and t.pop("k1") is None


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="positive"):
        AffinityTable(ttl_s=0, max_entries=1)
