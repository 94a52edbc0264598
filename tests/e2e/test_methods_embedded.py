"""The per-session method choice with a real embedded worker (the demo pair): the decisions name
their method, lookup requests propose from the context, and what the gateway believes of each
method (``/admin/sessions``) is what the worker's answers counted. Sampled (T 0.1, unseeded), so no
shadow evidence comes (tests/e2e/test_shadow_embedded.py has T=0) and an untried method is
explored; near greedy, so the repeated prompt's lookups are accepted (at T 0.3 a run once had
n-gram drafts proposed 33 times and none accepted)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections import defaultdict
from typing import Any

import pytest

from tests.e2e.harness import Gateway, GatewayFactory, sdk_client

# A prompt that repeats itself: the demo target continues code, and what it writes echoes it.
CODE = "".join(f"def field_{i}(self):\n    return self._field_{i}\n\n" for i in range(12))


@pytest.fixture(scope="module")
def gateway(gateway_factory: GatewayFactory) -> Gateway:
    return gateway_factory("gw-methods", workers={"count": 1}, workers_ready=1,
                           policy={"num_speculative_tokens": "auto", "methods": ["draft", "ngram", "suffix"],
                                   "method_explore_every": 1})


def test_each_method_runs_and_the_gateway_counts_what_the_worker_counted(gateway: Gateway) -> None:
    client = sdk_client(gateway)
    counted: dict[str, dict[str, int]] = defaultdict(lambda: {"proposed": 0, "accepted": 0})
    seen = []
    for turn in range(6):
        raw = client.completions.with_raw_response.create(
            model="specgate-demo", prompt=CODE + f"def field_{12 + turn}(self):\n", max_tokens=48, temperature=0.1,
            extra_headers={"X-Session-ID": "methods-code"})
        mode = raw.headers["X-Specgate-Mode"]
        answer: Any = raw.parse()
        seen.append(mode)
        assert mode.startswith("speculative; method=") or mode.startswith("plain"), mode
        if mode.startswith("speculative"):
            method = mode.split(";")[1].split("=")[1]
            spec = answer.usage.model_extra["speculative"]
            counted[method]["proposed"] += spec["proposed"]
            counted[method]["accepted"] += spec["accepted"]
    methods = {m.split(";")[1].strip() for m in seen if m.startswith("speculative")}
    assert {"method=ngram", "method=suffix"} <= methods, seen  # each untried method explored
    admin = gateway.get_json("/admin/sessions/methods-code")
    for method in ("ngram", "suffix"):
        evidence = admin["methods"][method]
        assert (evidence["drafts_proposed"], evidence["drafts_accepted"]) == (
            counted[method]["proposed"], counted[method]["accepted"]), (method, evidence, counted)
        assert evidence["steps"] > 0 and evidence["coverage"] is not None and evidence["shadow_steps"] == 0
    assert counted["ngram"]["proposed"] > 0 and counted["ngram"]["accepted"] > 0  # the prompt repeats: it found it
    draft = admin["acceptance"]
    assert (draft["drafts_proposed"], draft["drafts_accepted"]) == (counted["draft"]["proposed"],
                                                                     counted["draft"]["accepted"])
    # The session's `speculative` block is the sum of its answers' usage, per method and in all.
    speculative = admin["speculative"]
    for method, counts in counted.items():
        by_method = speculative["by_method"].get(method, {"proposed": 0, "accepted": 0})
        assert (by_method["proposed"], by_method["accepted"]) == (counts["proposed"], counts["accepted"]), method
    assert (speculative["proposed"], speculative["accepted"]) == (
        sum(c["proposed"] for c in counted.values()), sum(c["accepted"] for c in counted.values()))
    assert gateway.metric("specgate_method_decisions_total", method="ngram") >= 1
    assert gateway.metric("specgate_method_drafts_total", method="ngram", count="accepted") == counted["ngram"][
        "accepted"]


def test_an_unknown_method_is_refused_by_a_live_reload(gateway: Gateway) -> None:
    body = json.dumps({"methods": ["draft", "eagle"]}).encode()
    request = urllib.request.Request(gateway.url + "/admin/policy", body,
                                     {**gateway.headers, "Content-Type": "application/json"}, method="PUT")
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=10)
    body = json.loads(info.value.read())
    assert info.value.code == 400 and "policy.methods: unknown method 'eagle'" in body["error"]["message"]
    assert gateway.get_json("/admin/policy")["policy"]["methods"] == ["draft", "ngram", "suffix"]
