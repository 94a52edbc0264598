"""Token trees chosen per session, end to end: a real gateway over real sim workers (the GPU
deployment where verification is nearly free at batch 1, so trees pay at middling acceptance),
the openai SDK as the client. The choice shows in X-Specgate-Mode, /admin/sessions and the
metrics; a worker that serves chains only never gets a tree."""

from __future__ import annotations

import re
from typing import Any

from tests.e2e.harness import Gateway, GatewayFactory, sdk_client

SIM = {"time_scale": 0.05, "seed": 3}
# K auto with a tree tried on the prior at once (explore every request) and the low-acceptance
# rules out of the way: the session's α is middling by design ([math] at T=0.5: about 0.6).
POLICY = {"num_speculative_tokens": "auto", "tree_explore_every": 1, "acceptance_floor": 0.3,
          "acceptance_resume": 0.4}


def modes(gateway: Gateway, session: str, requests: int) -> list[str]:
    """X-Specgate-Mode of each of ``requests`` requests in one session."""
    out = []
    with sdk_client(gateway) as client:
        for i in range(requests):
            raw = client.completions.with_raw_response.create(
                model="specgate-demo", prompt="[math] integrate x^2", max_tokens=24, temperature=0.5, seed=i,
                extra_headers={"X-Session-ID": session})
            answer = raw.parse()
            assert answer.usage is not None and answer.usage.completion_tokens == 24
            out.append(raw.headers["X-Specgate-Mode"])
    return out


def session_view(gateway: Gateway, session: str) -> dict[str, Any]:
    view: dict[str, Any] = gateway.get_json(f"/admin/sessions/{session}")
    return view


def test_a_middling_session_on_a_gpu_fleet_gets_a_tree_and_it_shows(gateway_factory: GatewayFactory) -> None:
    gateway = gateway_factory("trees", workers_ready=1, policy=POLICY,
                              workers={"count": 1, "engine": "sim", "max_slots": 16, "sim": SIM})
    assert gateway.get_json("/admin/workers")["workers"][0]["tree_max_nodes"] > 0
    headers = modes(gateway, "tree-session", 8)
    trees = [h for h in headers if "tree=" in h]
    assert trees, (headers, session_view(gateway, "tree-session"))
    assert all(re.fullmatch(r"speculative; tree=[0-9x]+(\+[0-9]+)?; reason=default", h) for h in trees), trees
    view = session_view(gateway, "tree-session")
    # The steps' paths came back: rank-2 children were tested, and the estimate has them.
    assert view["rank_acceptance"], view
    shapes = {line for line in gateway.metrics().splitlines()
              if line.startswith("specgate_speculation_shapes_total{") and 'shape="chain"' not in line}
    assert shapes, "no tree shape counted"


def test_a_chains_only_worker_never_gets_a_tree(gateway_factory: GatewayFactory) -> None:
    gateway = gateway_factory("chains-only", workers_ready=1, policy=POLICY,
                              workers={"count": 1, "engine": "sim", "max_slots": 16,
                                       "sim": {**SIM, "tree_max_nodes": 0}})
    assert gateway.get_json("/admin/workers")["workers"][0]["tree_max_nodes"] == 0
    headers = modes(gateway, "chain-session", 8)
    assert not any("tree=" in h for h in headers), headers
    assert any(h.startswith("speculative; k=") for h in headers), headers
