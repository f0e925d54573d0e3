"""The plain parts of kvscope.replicas: ids, routing keys, the router's pick, merging."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("ray.serve", reason="Ray Serve is not installed: pip install 'kvscope[ray]'")

from kvscope.replicas.ids import id_prefix, owner_of, routing_key  # noqa: E402
from kvscope.replicas.merge import merge_metrics, merge_stats  # noqa: E402
from kvscope.replicas.router import pick  # noqa: E402


def test_ids_name_their_replica() -> None:
    request_id = id_prefix("ab12cd34") + "f" * 32
    assert owner_of(request_id) == "ab12cd34"
    assert owner_of("req-" + "f" * 32) is None  # the single server's ids
    assert owner_of("my-own-id") is None


def test_routing_key_path_then_header_then_query() -> None:
    owned = id_prefix("r1") + "0" * 32
    header = [(b"x-kvscope-replica", b"r2")]
    assert routing_key(f"/requests/{owned}", b"", header) == "r1"
    assert routing_key(f"/requests/{owned}/events", b"", []) == "r1"
    assert routing_key("/generate", b"replica=r3", header) == "r2"
    assert routing_key("/stats", b"replica=%400", []) == "@0"
    assert routing_key("/generate", b"", []) is None


def test_pick_by_name_or_index() -> None:
    replicas = [SimpleNamespace(replica_id=SimpleNamespace(unique_id=n)) for n in ("b", "a")]
    assert pick(replicas, "a") is replicas[1]
    assert pick(replicas, "@0") is replicas[1] and pick(replicas, "@1") is replicas[0]
    assert pick(replicas, "@2") is None and pick(replicas, "gone") is None


def test_merging_stats_and_metrics() -> None:
    merged = merge_stats({"a": {"running": 1, "pid": 7}, "b": {"running": 2, "pid": 8}})
    assert merged["running"] == 3 and "pid" not in merged
    assert merged["replicas"]["a"]["pid"] == 7
    text = "# HELP g a gauge\n# TYPE g gauge\ng 1.0\n"
    out = merge_metrics({"a": text, "b": text})
    assert out.count("# TYPE g gauge") == 1
    assert 'g{replica="a"} 1.0' in out and 'g{replica="b"} 1.0' in out
