"""``python -m bench.peer --quick`` and ``--fleet --quick`` run end to end against real
llama-servers and specgate, and print their tables and targets (the figures themselves are
the full runs', docs/measured.md)."""

from __future__ import annotations

import pytest

from tests.e2e.harness import bench_json

pytestmark = pytest.mark.llamacpp


def test_bench_peer_quick() -> None:
    out, stdout = bench_json("-m", "bench.peer", "--quick", "--json", timeout=600)
    assert out["bench"] == "peer" and out["failed"] == 0 and out["cpu"]
    assert set(out["targets"]) == {"plain_over_llamacpp", "default_over_llamacpp", "concurrent4_over_llamacpp"}
    assert all(t["ratio"] > 0 and isinstance(t["met"], bool) for t in out["targets"].values())
    configs = {row["config"] for row in out["rows"]}
    assert {"llama-server plain", "specgate plain", "specgate default"} <= configs
    reference = [row for row in out["rows"] if row["config"] == "llama-server plain" and row["class"] == "code"]
    assert reference and all(row["equal_to_llamacpp_plain"] == row["requests"] for row in reference)
    assert "plain_over_llamacpp" in stdout


def test_bench_peer_fleet_quick() -> None:
    out, stdout = bench_json("-m", "bench.peer", "--fleet", "--quick", "--json", timeout=600)
    assert out["failed"] == 0 and {arm["arm"] for arm in out["arms"]} >= {"two plain", "steered"}
    assert set(out["targets"]) == {"fleet_over_plain_servers", "fleet_over_best_static"}
    steered = next(arm for arm in out["arms"] if arm["arm"] == "steered")
    assert sum(sum(by.values()) for by in steered["sessions_by_last_server"].values()) == 2
    assert "fleet_over_best_static" in stdout
