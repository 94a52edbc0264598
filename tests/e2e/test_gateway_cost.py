"""K auto end to end: a gateway whose workers publish known cost curves gives a code session the
K those curves choose, in ``X-Specgate-Mode`` and ``/admin/sessions/{id}``.

The curves are injected the way a restarted worker finds its own: as the entry in the cost
cache under the key the worker computes, so the worker starts at once and publishes them.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from policies import CostModel, PolicyConfig, StepMix, choose_k
from tests.e2e.harness import MODELS, Gateway, sdk_client, start_gateway, write_config
from tests.unit.cost_curves import AMX_VERIFY, curve
from workers.costs.cache import CostCache
from workers.costs.cost_report import PrecisionCandidate, PrecisionChoice, report_from_forward_times
from workers.engines.embedded.measurement.settings import MeasureSettings

CODE_PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n    parser = "
AMX_DEPTH_1 = curve(AMX_VERIFY, 0.2)  # the AMX CPU's measured shape (issue #9)


def inject_costs(cache_dir: Path) -> CostModel:
    """A float32 target with the AMX CPU's batch-1 curve, and compute-bound at depth 16."""
    plain = [0.010, 0.040]
    target_s = [[plain[0] * v for v in AMX_VERIFY], [plain[1] * n for n in range(1, 10)]]
    choice = PrecisionChoice("float32", False, False, "injected by the test", 0.8,
                             (PrecisionCandidate("float32", False, False, 10.0, 11.0, 200.0, 6, 400.0),))
    report = report_from_forward_times((1, 16), target_s, [0.2 * plain[0], 0.2 * plain[1]], source="measured",
                                       precision=choice)
    # What the worker computes (workers.*: the harness's and the defaults; 1 torch thread).
    settings = MeasureSettings(MODELS / "demo-target", MODELS / "demo-draft", max_slots=16, max_k=8, threads=1)
    CostCache(cache_dir).store(settings.cache_key(), report)
    return report.policy_model()


@pytest.fixture(scope="module")
def injected(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gateway, CostModel]]:
    tmp = tmp_path_factory.mktemp("gw-cost")
    model = inject_costs(tmp / "costs")
    config = write_config(tmp / "config.yaml", workers={"cost_cache_dir": str(tmp / "costs")},
                          policy={"num_speculative_tokens": "auto"})
    gw = start_gateway(config, tmp)
    yield gw, model
    gw.stop()


def test_a_code_session_speculates_with_the_cost_model_k(injected: tuple[Gateway, CostModel]) -> None:
    gateway, model = injected
    (worker,) = gateway.get_json("/admin/workers")["workers"]
    published = worker["cost_model"]
    assert published["source"] in ("cache", "online") and published["precision"]["why"] == "injected by the test"
    assert worker["precision"]["target"] == "float32"  # the engine serves what the cost model chose
    assert CostModel.from_json(published) == model  # nothing has run yet: the injected curves
    # A new session on a worker with no evidence yet is costed at acceptance_resume (0.70) at depth 1,
    # alone on its worker (an empty draft mix).
    policy = PolicyConfig(num_speculative_tokens="auto")
    expected = choose_k(model, policy.acceptance_resume, 1, 8, policy.min_gain, policy.k_switch_gain, mix=StepMix())
    assert expected == 3
    with sdk_client(gateway) as client:
        raw = client.completions.with_raw_response.create(
            model="specgate-demo", prompt=CODE_PROMPT, max_tokens=24, temperature=0,
            extra_headers={"X-Session-ID": "code-auto"})
    assert raw.headers["X-Specgate-Mode"] == f"speculative; k={expected}; reason=default"
    usage = raw.parse().usage
    assert usage is not None and usage.model_extra is not None
    assert usage.model_extra["speculative"]["proposed"] > 0
    session = gateway.get_json("/admin/sessions/code-auto")
    assert (session["mode"], session["k"], session["reason"]) == ("speculative", expected, "default")
    assert session["mode_changes"][0]["k"] == expected
    # The worker's curves now follow its step timings (this CPU is not the injected one), as
    # the gateway sees them from its next poll of the worker.
    deadline = time.monotonic() + 10
    while True:
        (worker,) = gateway.get_json("/admin/workers")["workers"]
        if worker["cost_model"]["source"] == "online" or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert worker["cost_model"]["source"] == "online" and worker["cost_model"]["online_steps"] > 0
    assert worker["acceptance"] is not None  # the gateway's estimate over the worker's sessions


def test_fixed_k_keeps_todays_behaviour_after_a_live_edit(injected: tuple[Gateway, CostModel]) -> None:
    gateway, _ = injected
    request = urllib.request.Request(gateway.url + "/admin/policy", method="PUT",
                                     data=json.dumps({"num_speculative_tokens": 5}).encode())
    with urllib.request.urlopen(request, timeout=10) as response:
        assert json.load(response)["policy"]["num_speculative_tokens"] == 5
    try:
        with sdk_client(gateway) as client:
            raw = client.completions.with_raw_response.create(
                model="specgate-demo", prompt=CODE_PROMPT, max_tokens=8, temperature=0,
                extra_headers={"X-Session-ID": "code-fixed"})
        assert raw.headers["X-Specgate-Mode"] == "speculative; k=5; reason=default"
    finally:
        request = urllib.request.Request(gateway.url + "/admin/policy", method="PUT",
                                         data=json.dumps({"num_speculative_tokens": "auto"}).encode())
        with urllib.request.urlopen(request, timeout=10):
            pass


def test_the_gateway_tracks_each_workers_draft_mix(injected: tuple[Gateway, CostModel]) -> None:
    """While a speculative stream is in flight its worker's draft mix holds it (K auto prices a
    new session's step with it); once the stream ends the mix is empty again."""
    gateway, _ = injected
    with sdk_client(gateway) as client:
        stream = client.completions.with_raw_response.create(
            model="specgate-demo", prompt=CODE_PROMPT, max_tokens=400, temperature=0, stream=True,
            extra_headers={"X-Session-ID": "code-mix"})
        mode = stream.headers["X-Specgate-Mode"]
        chunks = iter(stream.parse())
        next(chunks)  # the stream is open: its request is in flight on the worker
        (worker,) = gateway.get_json("/admin/workers")["workers"]
        assert mode.startswith("speculative; k=")
        k = int(mode.split("k=")[1].split(";")[0])
        assert worker["draft_mix"] == {"by_k": {str(k): 1}, "drafting": 1, "drafts_per_step": k, "would_draft": 0,
                                       "lookups": 0}
        assert worker["in_flight"] == 1
        for _ in chunks:  # (it runs for seconds after the first chunk on this CPU)
            pass
    deadline = time.monotonic() + 10
    while gateway.get_json("/admin/workers")["workers"][0]["in_flight"] and time.monotonic() < deadline:
        time.sleep(0.05)
    (worker,) = gateway.get_json("/admin/workers")["workers"]
    assert worker["draft_mix"] == {"by_k": {}, "drafting": 0, "drafts_per_step": 0, "would_draft": 0, "lookups": 0}
