"""One HTTP request as the endpoint picker sees it: an ext_proc stream from Envoy.

Envoy sends the request's headers, then its body (whole, BUFFERED; or in pieces,
FULL_DUPLEX_STREAMED), then the response's headers and its streamed body. The picker answers
each. When the request's body is complete it runs the same admission as the relay (session,
route, ``decide``: gateway/admission.py), names the chosen endpoint to Envoy in the
``x-gateway-destination-endpoint`` header and in the ``envoy.lb`` dynamic metadata (the
Inference Extension's endpoint-picker protocol), and writes the decision into the body in the
model server's own terms; the session, mode and worker go back as ``specgate`` dynamic
metadata, which the route turns into the response's headers. The response's step reports fold
into the session as the relay folds them (gateway/epp/feedback.py); a request whose response
teaches nothing (``Picked.feedback``) has its response phases skipped (``mode_override``) where
Envoy lets the picker: at the response's headers in BUFFERED, at the pick for a request without
a body, never in FULL_DUPLEX_STREAMED.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any

import orjson
from envoy.config.core.v3.base_pb2 import HeaderValue, HeaderValueOption
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.type.v3.http_status_pb2 import HttpStatus
from google.protobuf.struct_pb2 import Struct
from multidict import CIMultiDict

from gateway.accounting import StreamTally, account_chunk
from gateway.admission import (
    Admission,
    accept_request,
    commit,
    directive_for,
    pick_ready,
    session_id_of,
)
from gateway.auth import AuthStore
from gateway.epp.feedback import ResponseReader
from gateway.fleet.handle import WorkerHandle
from gateway.fleet.worker_stream import scope_key, worker_body
from gateway.observe.tracing import AttemptTrace
from gateway.state import GatewayState
from gateway.tenancy import OPEN, worker_session_id
from workers.api.errors import ApiError, BadRequest, Overloaded, PayloadTooLarge, Unavailable
from workers.api.limits import InputRefused, loads_json
from workers.api.wire import CACHE_SALT_FIELD, SESSION_HEADER, CompletionRequest, RequestKind

log = logging.getLogger(__name__)
DESTINATION_HEADER = "x-gateway-destination-endpoint"
LB_NAMESPACE = "envoy.lb"  # the dynamic metadata namespace Envoy's load balancer reads
SUBSET_NAMESPACE = "envoy.lb.subset_hint"  # filter metadata: the endpoints the gateway allows
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
MODE_HEADER = "x-specgate-mode"
WORKER_HEADER = "x-specgate-worker"
# The picker's own dynamic metadata: the route copies these keys into the response headers
# (gateway/epp/envoy_config.py epp_bootstrap), for requests whose response phases are skipped too.
METADATA_NAMESPACE = "specgate"
ROUTE_HEADER = "x-specgate-route"
RESPONSE_HEADERS = {SESSION_HEADER.lower(): "session", MODE_HEADER: "mode", WORKER_HEADER: "worker",
                    ROUTE_HEADER: "route"}
_KINDS: dict[str, RequestKind] = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}
_OVERWRITE = HeaderValueOption.HeaderAppendAction.OVERWRITE_IF_EXISTS_OR_ADD


def _header(key: str, value: str) -> HeaderValueOption:
    return HeaderValueOption(header=HeaderValue(key=key, raw_value=value.encode()), append_action=_OVERWRITE)


def immediate(error: ApiError) -> ext_proc.ProcessingResponse:
    """An OpenAI error object that Envoy answers the client with, the request going nowhere."""
    headers = [_header("content-type", "application/json")]
    if error.retry_after_s is not None:
        headers.append(_header("retry-after", str(max(1, math.ceil(error.retry_after_s)))))
    return ext_proc.ProcessingResponse(immediate_response=ext_proc.ImmediateResponse(
        status=HttpStatus(code=error.status), body=orjson.dumps(error.body()),
        headers=ext_proc.HeaderMutation(set_headers=headers), details=f"specgate_{error.error_type}"))


@dataclass
class Picked:
    """Where a request goes and, for an OpenAI request, under which admission."""

    endpoint: str  # ip:port
    handle: WorkerHandle | None  # the model server (None: none, the request is refused)
    admission: Admission | None  # None: a request the policy has no say in (GET /v1/models)
    req: CompletionRequest | None
    body: bytes | None  # the body the model server gets (None: as the client sent it)

    @property
    def feedback(self) -> bool:
        """Whether the response tells the session anything: steps of a speculative decision that
        a specgate or vLLM server reports. A plain decision, a server of one fixed mode and a
        request the policy has no say in teach nothing; the picker need not see their responses."""
        admission = self.admission
        return (admission is not None and admission.decision.k > 0
                and admission.handle.protocol != "openai")


class Exchange:
    """The state of one ext_proc stream; ``handle`` answers each message Envoy sends."""

    def __init__(self, state: GatewayState, auth: AuthStore, endpoints: dict[str, str], max_body_bytes: int) -> None:
        self.state, self.auth, self.endpoints, self.max_body_bytes = state, auth, endpoints, max_body_bytes
        self.headers: CIMultiDict[str] = CIMultiDict()
        self.subset: frozenset[str] | None = None
        self.body = bytearray()
        self.streamed_request = False  # FULL_DUPLEX_STREAMED: the headers' answer waits for the body
        self.picked: Picked | None = None
        self.reader = ResponseReader()
        self.tally = StreamTally()
        self.started = time.monotonic()
        self.finished = False
        self.outcome = "picked"

    async def handle(self, message: ext_proc.ProcessingRequest) -> list[ext_proc.ProcessingResponse]:
        which = message.WhichOneof("request")
        if which == "request_headers":
            return await self._request_headers(message)
        if which == "request_body":
            return await self._request_body(message.request_body)
        if which == "request_trailers":
            return [ext_proc.ProcessingResponse(request_trailers=ext_proc.TrailersResponse())]
        if which == "response_headers":
            return [self._response_headers(message.response_headers)]
        if which == "response_body":
            return [self._response_body(message.response_body)]
        if which == "response_trailers":
            self.finish()
            return [ext_proc.ProcessingResponse(response_trailers=ext_proc.TrailersResponse())]
        return []

    def picks_on(self, message: ext_proc.ProcessingRequest) -> bool:
        """Whether this message completes the request, so that answering it means picking."""
        which = message.WhichOneof("request")
        if which == "request_headers":
            return bool(message.request_headers.end_of_stream)
        return which == "request_body" and bool(message.request_body.end_of_stream) and bool(self.headers)

    # -- the request --------------------------------------------------------------------------------
    async def _request_headers(self, message: ext_proc.ProcessingRequest) -> list[ext_proc.ProcessingResponse]:
        headers = message.request_headers
        self.headers = _header_map(headers)
        self.subset = _subset(message)
        if headers.end_of_stream:  # no body: a GET (models, probes), routed without a decision
            return await self._answer_headers_with_pick(b"")
        # BUFFERED mode answers headers at once and gets the whole body next; in
        # FULL_DUPLEX_STREAMED the headers' answer must carry the destination, so it waits.
        self.streamed_request = message.protocol_config.request_body_mode == ProcessingMode.FULL_DUPLEX_STREAMED
        if self.streamed_request:
            return []
        return [ext_proc.ProcessingResponse(request_headers=ext_proc.HeadersResponse())]

    async def _request_body(self, body: ext_proc.HttpBody) -> list[ext_proc.ProcessingResponse]:
        if not self.headers:  # not Envoy's order: nothing to route by
            return [self._refuse(BadRequest("ext_proc: a request body came before its headers"))]
        if len(self.body) + len(body.body) > self.max_body_bytes:
            self.outcome = "refused"
            return [immediate(PayloadTooLarge(f"request body is larger than {self.max_body_bytes} bytes"))]
        self.body += body.body
        if not body.end_of_stream:
            return [] if self.streamed_request else [ext_proc.ProcessingResponse(request_body=ext_proc.BodyResponse())]
        if self.streamed_request:
            return await self._answer_headers_with_pick(bytes(self.body))
        try:
            picked = await self._pick(bytes(self.body))
        except ApiError as error:
            return [self._refuse(error)]
        common = ext_proc.CommonResponse(header_mutation=self._destination(picked))
        if picked.body is not None:
            common.body_mutation.body = picked.body
        # Envoy ignores a mode_override on a body's answer: the response phases of a request
        # that teaches nothing end at the response's headers instead (_response_headers), whose
        # header mutation the route's headers (from this metadata) make redundant.
        return [ext_proc.ProcessingResponse(request_body=ext_proc.BodyResponse(response=common),
                                            dynamic_metadata=_metadata(picked))]

    async def _answer_headers_with_pick(self, body: bytes) -> list[ext_proc.ProcessingResponse]:
        try:
            picked = await self._pick(body)
        except ApiError as error:
            return [self._refuse(error)]
        first = ext_proc.ProcessingResponse(
            request_headers=ext_proc.HeadersResponse(response=ext_proc.CommonResponse(
                header_mutation=self._destination(picked))),
            dynamic_metadata=_metadata(picked))
        if not picked.feedback and not self.streamed_request:
            # Nothing to learn from the response (here: a request without a body, GET
            # /v1/models): Envoy sends the picker none of it. Envoy 1.40 ignores a mode_override
            # in FULL_DUPLEX_STREAMED, on any message: that mode keeps every response phase.
            first.mode_override.CopyFrom(ProcessingMode(
                request_header_mode=ProcessingMode.SEND, response_header_mode=ProcessingMode.SKIP,
                request_body_mode=ProcessingMode.NONE, response_body_mode=ProcessingMode.NONE))
        responses = [first]
        if self.streamed_request:  # the body goes on as one piece: the client's, or with the decision
            streamed = ext_proc.StreamedBodyResponse(body=picked.body if picked.body is not None else body,
                                                     end_of_stream=True)
            responses.append(ext_proc.ProcessingResponse(request_body=ext_proc.BodyResponse(
                response=ext_proc.CommonResponse(body_mutation=ext_proc.BodyMutation(streamed_response=streamed)))))
        return responses

    def _destination(self, picked: Picked) -> ext_proc.HeaderMutation:
        headers = [_header(DESTINATION_HEADER, picked.endpoint)]
        if picked.body is not None:
            headers.append(_header("content-length", str(len(picked.body))))
        # The client's API key was checked here and goes no further, as behind the relay; a
        # specgate worker off loopback wants the gateway's token instead (auth.worker_token).
        remove = ["authorization"]
        token = self.state.config.auth.worker_token
        if token and picked.handle is not None and picked.handle.speaks_specgate:
            headers.append(_header("authorization", f"Bearer {token}"))
            remove = []
        if picked.handle is not None and picked.handle.speaks_specgate:
            # As behind the relay: the worker matches a session's earlier prompts by the digest
            # of (key, id), never by the client's id (gateway/tenancy.py); no admitted session, none.
            if picked.admission is None:
                remove.append(SESSION_HEADER.lower())
            else:
                session = picked.admission.session
                headers.append(_header(SESSION_HEADER.lower(), worker_session_id(
                    session.scope, session.session_id, self.state.config.auth.cache_scope_secret)))
        return ext_proc.HeaderMutation(set_headers=headers, remove_headers=remove)

    def _refuse(self, error: ApiError) -> ext_proc.ProcessingResponse:
        self.outcome = "refused" if error.client_fault else ("shed" if isinstance(error, Overloaded) else "unavailable")
        log.info("endpoint picker refused a request (%d): %s", error.status, error.message)
        return immediate(error)

    async def _pick(self, body: bytes) -> Picked:
        state = self.state
        path = self.headers.get(":path", "").split("?", 1)[0]
        # The OpenAI routes want an API key, as behind the relay (gateway/auth.py), before anything else.
        caller = self.auth.caller_for(self.headers.get("authorization")) if path.startswith("/v1") else OPEN
        allowed = self._allowed()
        kind = _KINDS.get(path)
        if kind is None or self.headers.get(":method", "POST") != "POST":
            # Not a completion: any ready endpoint serves it (models list, probes).
            ready = [h for h in state.fleet.workers.values() if h.status == "ready" and h.worker_id in allowed]
            if not ready:
                raise Unavailable("no endpoint is ready", retry_after_s=1.0)
            handle = min(ready, key=lambda h: h.load)
            return Picked(self.endpoints[handle.worker_id], handle, None, None, None)
        try:
            raw = loads_json(body)
        except InputRefused as exc:
            raise BadRequest(str(exc), param=exc.param) from None
        req = accept_request(state, kind, raw, caller)
        session = state.sessions.touch(session_id_of(self.headers, req), self.started, caller.scope)
        session.requests += 1
        await state.store.load(session)
        policy = state.policy.active
        placed = await pick_ready(state, session, req, policy, allowed=allowed)
        handle, decision = placed.handle, placed.decision
        self._shed_if_full(handle)
        commit(state, session, handle, decision, policy)
        admission = Admission(session, handle, decision, policy, AttemptTrace(None), route=placed.route,
                              prefix_share=placed.prefix_share)
        self.picked = Picked(self.endpoints[handle.worker_id], handle, admission, req,
                             self._body_for(req, handle, admission, client_salted=CACHE_SALT_FIELD in raw))
        return self.picked

    def _allowed(self) -> frozenset[str]:
        """The workers the request may go to: those with a known endpoint, within the subset hint."""
        known = frozenset(worker_id for worker_id in self.state.fleet.workers if worker_id in self.endpoints)
        if self.subset is None:
            return known
        allowed = frozenset(w for w in known if self.endpoints[w] in self.subset)
        if not allowed:
            raise Unavailable(f"none of the endpoints in {SUBSET_KEY} is in the pool")
        return allowed

    def _shed_if_full(self, handle: WorkerHandle) -> None:
        workers = self.state.config.workers
        if handle.load >= workers.max_slots + workers.max_queue:
            raise Overloaded("every eligible endpoint's queue is full", retry_after_s=1.0)

    def _body_for(self, req: CompletionRequest, handle: WorkerHandle, admission: Admission,
                  client_salted: bool) -> bytes | None:
        if handle.protocol == "openai" and not client_salted:
            return None  # a server of one fixed mode: the choice of endpoint was the decision
        policy, decision = admission.policy, admission.decision
        # A whole answer's step log, for the feedback: a plain decision's would teach nothing, and
        # its response passes the picker unread (Picked.feedback), so it is not asked for.
        directive = directive_for(decision, policy, step_log=not req.stream and decision.k > 0)
        admission.lease = handle.lease(scope_key(req))
        return orjson.dumps(worker_body(req, directive, handle.protocol, streamed=False, lease=admission.lease))

    # -- the response -------------------------------------------------------------------------------
    def _response_headers(self, headers: ext_proc.HttpHeaders) -> ext_proc.ProcessingResponse:
        values = _header_map(headers)
        try:
            status = int(values.get(":status", "0"))
        except ValueError:
            status = 0
        self.reader.headers(status, values.get("content-type", ""))
        response = ext_proc.ProcessingResponse(response_headers=ext_proc.HeadersResponse())
        picked = self.picked
        if picked is None or picked.admission is None or not picked.feedback:
            # Nothing to learn from the body (the pick, on a body's answer, could not say so): skip it.
            response.mode_override.response_body_mode = ProcessingMode.NONE
            if picked is not None and picked.admission is not None:
                self._add_headers(response, picked.admission)
            if headers.end_of_stream:
                self.finish()
            return response
        admission = picked.admission
        self._add_headers(response, admission)
        mutation = response.response_headers.response.header_mutation
        if self.reader.ok and not self.reader.streaming and admission.handle.speaks_specgate:
            # The whole answer at once, so its step log can leave it: its length changes.
            mutation.remove_headers.append("content-length")
            response.mode_override.response_body_mode = ProcessingMode.BUFFERED
        if headers.end_of_stream:
            self.finish()
        return response

    @staticmethod
    def _add_headers(response: ext_proc.ProcessingResponse, admission: Admission) -> None:
        # The route adds the same from the pick's metadata; set here too, they agree.
        response.response_headers.response.header_mutation.set_headers.extend(
            _header(key, value) for key, value in _response_headers(admission).items())

    def _response_body(self, body: ext_proc.HttpBody) -> ext_proc.ProcessingResponse:
        response = ext_proc.ProcessingResponse(response_body=ext_proc.BodyResponse())
        picked = self.picked
        if picked is None or picked.admission is None or picked.req is None:
            if body.end_of_stream:
                self.finish()
            return response
        admission, kind, now = picked.admission, picked.req.kind, time.monotonic()
        if self.reader.streaming:
            for raw in self.reader.stream_piece(body.body):
                self.state.settle(account_chunk(admission, self.tally, raw, kind, self.started, now))
        elif body.end_of_stream:
            whole, stripped = self.reader.whole_answer(body.body)
            if whole is not None:
                self.state.settle(account_chunk(admission, self.tally, whole, kind, self.started, now))
            if stripped is not None:
                response.response_body.response.body_mutation.body = stripped
        else:
            self.reader.answer_piece(body.body)
        if body.end_of_stream:
            self.finish()
        return response

    def finish(self) -> None:
        """The exchange is over (its response ended, or Envoy closed the stream): the request
        leaves its worker's in-flight count, and the session's state is written."""
        if self.finished:
            return
        self.finished = True
        picked = self.picked
        if picked is not None and picked.admission is not None:
            picked.admission.handle.draft_mix.remove(picked.admission.decision)
            picked.admission.handle.release(picked.admission.lease)
            self.state.store.save(picked.admission.session)


def _header_map(headers: ext_proc.HttpHeaders) -> CIMultiDict[str]:
    """Envoy's headers by name, any case (Envoy sends values in ``raw_value``; older ones in ``value``)."""
    return CIMultiDict((h.key, h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value)
                       for h in headers.headers.headers)


def _subset(message: ext_proc.ProcessingRequest) -> frozenset[str] | None:
    """The endpoints the subset hint allows; None without a hint."""
    metadata = message.metadata_context.filter_metadata
    if SUBSET_NAMESPACE not in metadata:
        return None
    value: Any = dict(metadata[SUBSET_NAMESPACE].items()).get(SUBSET_KEY)
    if value is None:
        return None
    items = value.split(",") if isinstance(value, str) else list(value)
    return frozenset(str(item).strip() for item in items if str(item).strip())


def _response_headers(admission: Admission) -> dict[str, str]:
    return {SESSION_HEADER.lower(): admission.session.session_id, MODE_HEADER: admission.decision.header,
            WORKER_HEADER: admission.handle.worker_id, ROUTE_HEADER: admission.route}


def _metadata(picked: Picked) -> Struct:
    """The pick as dynamic metadata: the endpoint for Envoy's load balancer, and for an OpenAI
    request the response headers the route adds (keys of ``METADATA_NAMESPACE``)."""
    metadata = Struct()
    metadata.update({LB_NAMESPACE: {DESTINATION_HEADER: picked.endpoint}})
    if picked.admission is not None:
        values = _response_headers(picked.admission)
        metadata.update({METADATA_NAMESPACE: {RESPONSE_HEADERS[key]: value for key, value in values.items()}})
    return metadata
