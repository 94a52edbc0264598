"""Tenant isolation (issue 52): one tenant's prompts never show in another's answers.

Real gateways and embedded workers (the demo pair) on loopback, the official ``openai`` SDK:
- two API keys on one worker with a prefix cache: key B, sending the system prompt key A sent,
  gets no cached tokens, no ``prefix`` route and a cold time to first token, while key A's second
  request still hits; two keys of one named tenant share hits; one key with two ``cache_salt``s
  does not;
- the suffix method: a session of key B on a text key A's session generated gets no proposals
  from it (it proposes what a fresh key proposes), a session of key A does; both use one
  ``X-Session-ID``;
- the same answers through the endpoint picker behind the real Envoy, and through a relay whose
  session state lives in Redis;
- bad ``cache_salt`` values are 400s naming the field, with vLLM's message.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from bench.procs import free_port
from gateway.epp.envoy_config import epp_bootstrap
from tests.e2e.envoy_harness import start_envoy
from tests.e2e.epp_harness import start_epp
from tests.e2e.harness import GatewayFactory, start_tcp_worker
from tests.e2e.redis_harness import start_redis
from tests.e2e.tenancy_harness import API_KEYS, KEY_A, suffix_proposals_stay_in_scope, two_keys_never_share
from workers.api.wire import CACHE_SALT_EMPTY, CACHE_SALT_MESSAGE

SUFFIX_POLICY = {"methods": ["suffix"], "num_speculative_tokens": 8}


@pytest.fixture(scope="module")
def gateway_url(gateway_factory: GatewayFactory) -> str:
    gateway = gateway_factory("gw-tenancy", auth={"api_keys": API_KEYS},
                              workers={"count": 1, "prefix_cache_mb": 64}, policy=SUFFIX_POLICY, workers_ready=1)
    return gateway.base_url


def test_two_keys_on_one_worker_share_no_cache(gateway_url: str) -> None:
    two_keys_never_share(gateway_url)


def test_lookup_proposals_stay_in_their_scope(gateway_url: str) -> None:
    suffix_proposals_stay_in_scope(gateway_url)


@pytest.mark.parametrize(("salt", "message"), [("", CACHE_SALT_EMPTY), (7, CACHE_SALT_EMPTY), (["a"], CACHE_SALT_EMPTY),
                                               ("x" * 129, CACHE_SALT_MESSAGE), ("a/b", CACHE_SALT_MESSAGE),
                                               ("a@b", CACHE_SALT_MESSAGE), ("a\\b", CACHE_SALT_MESSAGE),
                                               ("a\x00b", CACHE_SALT_MESSAGE)])
def test_a_bad_cache_salt_is_a_400_naming_it(gateway_url: str, salt: Any, message: str) -> None:
    """vLLM 0.32's rule and its two messages, word for word (the vLLM lane sends vLLM the same)."""
    with openai.OpenAI(base_url=gateway_url, api_key=KEY_A, max_retries=0, timeout=60) as client:
        for create in (lambda: client.completions.create(model="specgate-demo", prompt="x", max_tokens=1,
                                                         extra_body={"cache_salt": salt}),
                       lambda: client.chat.completions.create(model="specgate-demo", max_tokens=1,
                                                              messages=[{"role": "user", "content": "x"}],
                                                              extra_body={"cache_salt": salt})):
            with pytest.raises(openai.BadRequestError) as caught:
                create()
            error: Any = caught.value.body
            assert error["param"] == "cache_salt" and error["message"] == message, (salt, error)


@pytest.fixture(scope="module")
def redis_gateway_url(gateway_factory: GatewayFactory, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    redis = start_redis(tmp_path_factory.mktemp("tenancy-redis"))
    try:
        gateway = gateway_factory("gw-tenancy-redis", auth={"api_keys": API_KEYS},
                                  workers={"count": 1, "prefix_cache_mb": 64}, policy=SUFFIX_POLICY,
                                  state={"backend": "redis", "redis_url": redis.url}, workers_ready=1)
        yield gateway.base_url
    finally:
        redis.stop()


def test_the_same_with_session_state_in_redis(redis_gateway_url: str) -> None:
    two_keys_never_share(redis_gateway_url)
    suffix_proposals_stay_in_scope(redis_gateway_url)


@contextlib.contextmanager
def picker_behind_envoy(tmp: Path) -> Iterator[str]:
    """A specgate worker with a prefix cache behind ``specgate epp`` and the real Envoy."""
    process, port = start_tcp_worker(tmp, "--prefix-cache-mb", "64", "--max-slots", "4")
    epp = envoy = None
    try:
        epp = start_epp(tmp, [{"url": f"http://127.0.0.1:{port}", "protocol": "specgate", "name": "w0"}],
                        auth={"api_keys": API_KEYS}, policy=SUFFIX_POLICY)
        envoy = start_envoy(epp_bootstrap(free_port(), free_port(), [("127.0.0.1", epp.grpc_port)]),
                            tmp / "envoy.log")
        epp.gateway.wait_workers_ready(1)
        yield envoy.base_url
    finally:
        if envoy is not None:
            envoy.stop()
        if epp is not None:
            epp.stop()
        process.terminate()
        process.wait(timeout=30)


def test_the_same_through_the_endpoint_picker(tmp_path: Path) -> None:
    with picker_behind_envoy(tmp_path) as base_url:
        two_keys_never_share(base_url)
        suffix_proposals_stay_in_scope(base_url)
