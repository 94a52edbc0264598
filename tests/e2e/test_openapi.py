"""GET /openapi.json against a real gateway: the document is valid OpenAPI, and schemathesis-generated
requests (fixed seed, bounded examples) never get a 5xx nor a response the document does not allow."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import checks
from schemathesis.generation import GenerationMode

from tests.e2e.harness import Gateway
from workers.api.schema import ChatCompletionBody, CompletionBody

# Response checks: status codes, content types, bodies and headers as documented, and no 5xx.
# Not positive_data_acceptance: a valid-looking request can still be refused for what no schema
# states (a token id beyond the vocabulary, a prompt longer than the context window), with a
# documented 400.
RESPONSE_CHECKS = [checks.not_a_server_error, checks.status_code_conformance, checks.content_type_conformance,
                   checks.response_schema_conformance, checks.response_headers_conformance]
EXAMPLES = 30  # per operation and mode: enough to reach every field, cheap enough for the 2-core CPU
POST_OPERATIONS = ("/v1/completions", "/v1/chat/completions")


def cheap(document: dict[str, Any]) -> dict[str, Any]:
    """The document with generation kept short: ``max_tokens`` required and at most 4.

    Without it a request may generate up to the context window, which costs seconds per case.
    Only the positive cases use this; negative cases break the real document somewhere and are
    refused before any generation.
    """
    doc = copy.deepcopy(document)
    for body in ("CompletionBody", "ChatCompletionBody"):
        schema = doc["components"]["schemas"][body]
        schema["properties"]["max_tokens"] = {"type": "integer", "minimum": 1, "maximum": 4}
        schema["required"] = [*schema["required"], "max_tokens"]
    chat = doc["components"]["schemas"]["ChatCompletionBody"]["properties"]
    chat["max_completion_tokens"] = {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 4}, {"type": "null"}]}
    return doc


def test_document_describes_the_validating_models(gateway: Gateway) -> None:
    doc = gateway.get_json("/openapi.json")
    assert doc["openapi"].startswith("3.1")
    assert set(doc["paths"]) == {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/ready"}
    schemas = doc["components"]["schemas"]
    for model in (CompletionBody, ChatCompletionBody):
        documented = set(schemas[model.__name__]["properties"])
        # Every public field of the model, none of the gateway-only ones.
        assert documented == set(model.model_fields) - {"specgate", "vllm_xargs"}
        assert schemas[model.__name__]["additionalProperties"] is False
        assert schemas[model.__name__]["properties"]["model"]["enum"] == ["specgate-demo"]
    for name in ("ErrorResponse", "CompletionResponse", "ChatCompletionResponse", "ModelList"):
        assert name in schemas
    loaded = schemathesis.openapi.from_dict(doc)  # schemathesis validates the document as it loads
    for path, operations in doc["paths"].items():
        for method in operations:
            assert loaded[path][method.upper()].path == path


@pytest.mark.parametrize("path", POST_OPERATIONS)
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_generated_requests_get_documented_answers(gateway: Gateway, path: str, mode: GenerationMode) -> None:
    document = gateway.get_json("/openapi.json")
    schema = schemathesis.openapi.from_dict(cheap(document) if mode == GenerationMode.POSITIVE else document)
    operation = schema[path]["POST"]
    statuses: list[int] = []
    log_start = len(gateway.log())

    @settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def check(case: Any) -> None:
        response = case.call(base_url=gateway.url, timeout=60)
        statuses.append(response.status_code)
        case.validate_response(response, checks=RESPONSE_CHECKS)

    check()
    assert statuses, "no request was generated"
    logged = gateway.log()[log_start:]
    assert " ERROR " not in logged and "Traceback" not in logged, logged
    if mode == GenerationMode.POSITIVE:
        assert 200 in statuses, statuses  # the generator reached real completions, not just refusals
    else:
        assert all(400 <= s < 500 for s in statuses), statuses


def test_get_routes_match_the_document(gateway: Gateway) -> None:
    schema = schemathesis.openapi.from_dict(gateway.get_json("/openapi.json"))
    for path in ("/v1/models", "/health", "/ready"):
        case = schema[path]["GET"].Case()
        response = case.call(base_url=gateway.url, timeout=10)
        assert response.status_code == 200
        case.validate_response(response, checks=RESPONSE_CHECKS)
