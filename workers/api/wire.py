"""The wire types between clients, the gateway and workers. Imports no torch.

- The specgate extension fields: the gateway's ``specgate`` directive in a request (mode, K,
  batch thresholds) and the per-chunk ``specgate`` step report from a worker; a worker's
  whole answer (``WHOLE_ANSWER_TYPE``: the answer's JSON, then its step report's); the headers
  that carry the request id and session to a worker for its log lines.
- The frozen ``CompletionRequest`` a request body is parsed into (workers/api/request_parser.py).
- ``StepReport`` and its readers and writers: a worker's chunk report, vLLM's usage metrics as
  one, and a non-streaming answer's step log.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

from policies.methods import METHODS, Method, is_lookup
from workers.api.generation import ShadowSteps, SpecSteps, group_steps, step_runs

RequestKind = Literal["chat", "completion"]
DIRECTIVE_FIELD = "specgate"
# Towards a vLLM server with specgate's scheduler plugin the directive travels in vLLM's own
# per-request extension field, under the plugin's names (workers/vllm_plugin/specgate_vllm/rules.py).
VLLM_XARGS_FIELD = "vllm_xargs"
VLLM_SPEC_K, VLLM_MAX_BATCH, VLLM_BATCH_RESUME = "spec_k", "spec_max_batch", "spec_batch_resume"
# A streamed chunk's token ids and, in the first chunk, the prompt's travel in an SSE comment,
# an event of its own just before the chunk's (``: ids {"token_ids": [...], "prompt_ids": [...]}``):
# every SSE client ignores comments, so the chunk stays an OpenAI chunk and the gateway can relay
# its bytes untouched while it keeps the ids (for resuming on another worker, gateway/relay/migration.py).
# Its own event, not a line of the chunk's: vLLM's bench client drops a whole event that starts
# with a comment line, so behind Envoy, where worker bytes reach it, it saw no token at all.
TOKEN_IDS_FIELD, PROMPT_IDS_FIELD = "token_ids", "prompt_ids"
IDS_COMMENT = b": ids "
# A whole answer (``Directive.whole_answer``, workers/server/coalesce.py): its body is the OpenAI answer's
# JSON, then the step report's; this header says where the answer ends.
WHOLE_ANSWER_TYPE = "application/x-specgate-answer"
ANSWER_BYTES_HEADER = "X-Specgate-Answer-Bytes"
HELD_FIELD = "held_s"  # a coalesced chunk's report: how long its first step waited (workers/server/coalesce.py)
# Fields the gateway sets for its workers; a client sending one is refused.
GATEWAY_FIELDS = (DIRECTIVE_FIELD, VLLM_XARGS_FIELD)
# The session key clients send the gateway. The gateway also sends it, and its own request id,
# to specgate workers, which tag their log lines with both (workers/api/logs.py).
SESSION_HEADER, REQUEST_ID_HEADER = "X-Session-ID", "X-Request-ID"
MAX_SESSION_ID = 256  # characters; a longer X-Session-ID is refused (printable ASCII only)
# vLLM's per-request cache scope: requests with different salts never share a cached block. A
# client's salt is checked by vLLM's rule; the gateway replaces it with its scope's digest
# (gateway/tenancy.py), which is what a worker keys its caches by.
CACHE_SALT_FIELD = "cache_salt"
MAX_CACHE_SALT = 128
CACHE_SALT_FORBIDDEN = ("@", "/", "\\", "\0")
# vLLM 0.32's messages (entrypoints/generate/base/protocol.py validate_cache_salt), word for word.
CACHE_SALT_EMPTY = "Parameter 'cache_salt' must be a non-empty string if provided."
CACHE_SALT_MESSAGE = (f"Parameter 'cache_salt' must be at most {MAX_CACHE_SALT} characters and must not contain "
                      "'@', '/', '\\\\', or NUL.")


def cache_salt_problem(value: object) -> str | None:
    """vLLM's rule for ``cache_salt`` (None and a valid salt: no problem), in vLLM's words."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        return CACHE_SALT_EMPTY
    if len(value) > MAX_CACHE_SALT or any(c in value for c in CACHE_SALT_FORBIDDEN):
        return CACHE_SALT_MESSAGE
    return None


def valid_session_id(value: str) -> bool:
    """A session id a client may send: printable ASCII (a header's bytes are decoded as
    Latin-1, so other text would come back to the client as other bytes), not too long."""
    return 0 < len(value) <= MAX_SESSION_ID and value.isascii() and value.isprintable()


@dataclass(frozen=True)
class ChatMessage:
    role: Literal["system", "user", "assistant"]
    content: str


@dataclass(frozen=True)
class ResumePoint:
    """Where a generation that another worker began stands (``specgate.resume``).

    Token ids, not text: stop-string holdback means the text a client has is not the text of
    the tokens generated, and a chat cannot be continued from text through the OpenAI API.
    """

    prompt_ids: tuple[int, ...]  # as the first worker templated and tokenized the request
    output_ids: tuple[int, ...]  # generated so far (and counted in the usage)
    text_sent: int = 0  # characters of the output's text the client already has

    def to_json(self) -> dict[str, Any]:
        return {"prompt_ids": list(self.prompt_ids), "output_ids": list(self.output_ids),
                "text_sent": self.text_sent}


@dataclass(frozen=True)
class Directive:
    """The gateway's decision for one request, carried to the worker in ``specgate``."""

    k: int  # drafts per step; 0 = plain
    max_batch: int  # the worker goes plain for a step while its batch depth is above this
    batch_resume: int  # ...until it falls below this
    max_step_drafts: int = 0  # drafts per step across the batch before K shrinks (0: no limit)
    resume: ResumePoint | None = None  # continue from here instead of from the request's prompt
    # Policy K "auto": each step, the worker also runs plain (or shallower) at a batch depth
    # where its cost model says the requested K loses (policies.cost.step_k).
    cost_rule: bool = False
    # A non-streaming client's request: after the first chunk, the worker may send the chunks
    # of this many seconds as one (``StepReport.then``), so the gateway reads, parses and
    # accounts a few events instead of one per step (0: a chunk per step).
    coalesce_s: float = 0.0
    # With ``coalesce_s``: an answer made within the first span may come as the answer itself
    # and its step report (``WHOLE_ANSWER_TYPE``), which the gateway relays without reading it.
    whole_answer: bool = False
    # A non-streaming answer that no gateway reads step by step (the endpoint picker's: Envoy
    # relays it): the answer carries its steps' drafts, in order, in ``specgate.steps``, so the
    # picker folds the session's acceptance exactly as the relay folds a stream's reports.
    step_log: bool = False
    # A token tree instead of a chain (its notation, policies/tree.py: "2x2+3"); ``k`` is then its depth.
    tree: str | None = None
    # A lookup method to propose with instead of the draft model (policies/methods.py); None: the draft.
    method: Method | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"k": self.k, "max_batch": self.max_batch, "batch_resume": self.batch_resume}
        if self.max_step_drafts:
            out["max_step_drafts"] = self.max_step_drafts
        if self.resume is not None:
            out["resume"] = self.resume.to_json()
        if self.cost_rule:  # absent unless set: workers from before the cost model take the rest
            out["cost_rule"] = True
        if self.coalesce_s > 0:
            out["coalesce_s"] = self.coalesce_s
        if self.whole_answer:  # absent unless set (a worker refuses fields it does not know: same release)
            out["whole_answer"] = True
        if self.step_log:
            out["step_log"] = True
        if self.tree is not None:  # absent unless set, as the fields above
            out["tree"] = self.tree
        if self.method is not None:
            out["method"] = self.method
        return out


def vllm_xargs(directive: Directive) -> dict[str, int]:
    return {VLLM_SPEC_K: directive.k, VLLM_MAX_BATCH: directive.max_batch, VLLM_BATCH_RESUME: directive.batch_resume}


@dataclass(frozen=True)
class CompletionRequest:
    kind: RequestKind
    model: str
    prompt: str | list[int] | None = None  # completions
    messages: tuple[ChatMessage, ...] = ()  # chat
    max_tokens: int | None = None  # None: up to the context window
    temperature: float = 1.0  # OpenAI's default
    top_p: float = 1.0
    top_k: int = 0  # extension (vLLM's name); 0 disables
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # vLLM's extension: EOS does not end the generation
    min_tokens: int = 0  # vLLM's extension: no EOS and no stop string before this many tokens
    stream: bool = False
    include_usage: bool = False
    user: str | None = None
    directive: Directive | None = None
    # The cache scope: the client's salt (checked by vLLM's rule); behind the gateway, the
    # digest of the request's (tenant, salt). None: the default scope.
    cache_salt: str | None = None
    raw: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)



@dataclass(frozen=True)
class StepReport:
    """The per-chunk ``specgate`` field a worker attaches: what the step behind it did."""

    proposed: int  # drafts proposed in the step behind this chunk
    accepted: int  # drafts accepted
    batch_depth: int  # the worker's running sequences at that step
    k: int  # K used at that step (0: plain)
    tokens: int  # tokens the step emitted
    # Steps whose acceptance the engine learned late (vLLM reports it when a request ends):
    # ``count`` steps of ``proposed`` drafts with ``accepted`` accepted each.
    late_steps: tuple[SpecSteps, ...] = ()
    # The ids of the ``tokens`` counted above, and (first chunk only) the prompt's: what the
    # gateway needs to resume the generation on another worker should this one die. They are
    # not part of the chunk's JSON but of its SSE event (``ids_comment``).
    token_ids: tuple[int, ...] | None = None
    prompt_ids: tuple[int, ...] | None = None
    # A coalesced chunk (``Directive.coalesce_s``): the steps after this one, in order, whose
    # text the chunk carries too. ``token_ids`` then holds every step's ids.
    then: tuple[StepReport, ...] = ()
    # A coalesced chunk: how long its first step waited in the worker before it was sent (the
    # gateway's time to first token counts from when the token was made, not relayed).
    held_s: float = 0.0
    # A tree step: the tree's notation, and the rank accepted at each level tested (0: every child
    # of that level rejected; policies.tree.StepPath). ``proposed`` is then the tree's depth and
    # ``accepted`` the levels passed. None for chains and plain steps.
    tree: str | None = None
    path: tuple[int, ...] | None = None
    # A request's last step: what each lookup method it did not run would have done on its output
    # (``ShadowSteps``; worker to gateway only, never in the client's answer).
    shadow: tuple[ShadowSteps, ...] = ()
    # A request's first step, where the worker has a prefix cache: (the prompt's tokens, those of
    # them served from the cache), for the gateway's prefix index to learn what the worker holds
    # (worker to gateway only, as ``usage.prompt_tokens_details.cached_tokens`` says to the client).
    cached: tuple[int, int] | None = None

    def steps(self) -> tuple[StepReport, ...]:
        """Every step behind the chunk, in order."""
        return (self, *self.then) if self.then else (self,)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"proposed": self.proposed, "accepted": self.accepted, "batch_depth": self.batch_depth,
                               "k": self.k, "tokens": self.tokens}
        if self.late_steps:
            out["late_steps"] = [[g.proposed, g.accepted, g.count] for g in self.late_steps]
        if self.then:
            out["then"] = [step.to_json() for step in self.then]
        if self.held_s:
            out[HELD_FIELD] = self.held_s
        if self.tree is not None and self.path is not None:
            out["tree"], out["path"] = self.tree, list(self.path)
        if self.shadow:
            out[SHADOW_FIELD] = {s.method: [[r.proposed, r.accepted, r.count] for r in s.runs] for s in self.shadow}
        if self.cached is not None:
            out[CACHED_FIELD] = list(self.cached)
        return out

    def ids_comment(self) -> bytes:
        """The SSE comment event that carries this step's ids, sent just before the chunk's own
        (empty when it has none)."""
        ids: dict[str, list[int]] = {}
        if self.token_ids is not None:
            ids[TOKEN_IDS_FIELD] = list(self.token_ids)
        if self.prompt_ids is not None:
            ids[PROMPT_IDS_FIELD] = list(self.prompt_ids)
        return IDS_COMMENT + orjson.dumps(ids) + b"\n\n" if ids else b""

    @classmethod
    def from_json(cls, raw: Any) -> StepReport | None:
        if not isinstance(raw, dict):  # what a JSON object parses to
            return None
        later = raw.get("then")
        then: tuple[StepReport, ...] = ()
        if later and isinstance(later, list):  # one level: a later step's own ``then`` is ignored
            then = tuple(step for step in map(cls._later_step, later) if step is not None)
        held = raw.get(HELD_FIELD)
        if not isinstance(held, (int, float)) or isinstance(held, bool) or not 0 < held < 3600:
            held = 0.0  # absent, or nothing a worker would say
        return cls._step(raw, then, float(held))

    @classmethod
    def _later_step(cls, raw: Any) -> StepReport | None:
        """A coalesced chunk's later step. Its reports repeat (a plain stream's are all alike),
        and a report is immutable, so equal ones are one object: building a frozen dataclass
        was most of the cost of reading a coalesced chunk's steps."""
        if not isinstance(raw, dict) or "late_steps" in raw or SHADOW_FIELD in raw or CACHED_FIELD in raw:
            return cls._step(raw)
        try:
            path = raw.get("path")
            key = (raw["proposed"], raw["accepted"], raw["batch_depth"], raw["k"], raw["tokens"], raw.get("tree"),
                   tuple(path) if type(path) is list else path)
            step = _LATER_STEPS.get(key)
        except (KeyError, TypeError):  # a missing field, or a value that cannot be a key
            return cls._step(raw)
        if step is None:
            step = cls._step(raw)
            if step is not None:
                if len(_LATER_STEPS) >= _LATER_STEPS_MAX:
                    _LATER_STEPS.clear()
                _LATER_STEPS[key] = step
        return step

    @classmethod
    def _step(cls, raw: Any, then: tuple[StepReport, ...] = (), held_s: float = 0.0) -> StepReport | None:
        # Parsed for every relayed chunk: no generator unless the step has late steps.
        if not isinstance(raw, dict):
            return None
        try:
            late_raw = raw.get("late_steps")
            late = tuple(SpecSteps(int(p), int(a), int(c)) for p, a, c in late_raw) if late_raw else ()
            tree, path = _tree_path(raw.get("tree"), raw.get("path"))
            shadow = _shadow(raw[SHADOW_FIELD]) if SHADOW_FIELD in raw else ()
            cached = _cached(raw[CACHED_FIELD]) if CACHED_FIELD in raw else None
            return cls(int(raw["proposed"]), int(raw["accepted"]), int(raw["batch_depth"]), int(raw["k"]),
                       int(raw["tokens"]), late, then=then, held_s=held_s, tree=tree, path=path, shadow=shadow,
                       cached=cached)
        except (KeyError, TypeError, ValueError):
            return None


SHADOW_FIELD = "shadow"
CACHED_FIELD = "cached"

MAX_SHADOW_RUNS = 1 << 16  # runs per method in one report (a step emits a token: the context bounds them)


def _shadow(raw: Any) -> tuple[ShadowSteps, ...]:
    """A report's ``shadow`` field: runs per lookup method (``ShadowSteps``). An unknown method or
    an oversized list is left out; counts are checked by the gateway as a step's are."""
    if not isinstance(raw, dict):
        return ()
    out = []
    for method in METHODS:
        runs = raw.get(method) if is_lookup(method) else None
        if isinstance(runs, list) and len(runs) <= MAX_SHADOW_RUNS:
            try:
                out.append(ShadowSteps(method, tuple(SpecSteps(int(p), int(a), max(0, int(c))) for p, a, c in runs)))
            except (TypeError, ValueError):  # a malformed run: that method's shadow alone is left out
                continue
    return tuple(out)


def _cached(raw: Any) -> tuple[int, int] | None:
    """A report's ``cached`` field, [prompt tokens, cached tokens]; None unless it is one a worker
    could mean (0 <= cached <= prompt)."""
    if not isinstance(raw, list) or len(raw) != 2 or not all(type(n) is int for n in raw):
        return None
    prompt, cached = raw
    return (prompt, cached) if 0 <= cached <= prompt else None


def shadow_of(method: Method, steps: Iterable[tuple[int, int]]) -> ShadowSteps:
    """A replay's steps, in order, as the report carries them."""
    return ShadowSteps(method, step_runs(steps))


MAX_PATH = 64  # levels in a reported path (a tree is at most policies.tree.MAX_TREE_DEPTH deep)


def _tree_path(tree: Any, path: Any) -> tuple[str | None, tuple[int, ...] | None]:
    """A tree step's shape and path as reported, both or neither (the gateway checks them
    against each other, policies.tree.StepPath); anything malformed reads as a chain step."""
    if tree is None or path is None:
        return None, None
    if (not isinstance(tree, str) or len(tree) > 40 or not isinstance(path, list) or len(path) > MAX_PATH
            or not all(type(r) is int and r >= 0 for r in path)):
        return None, None
    return tree, tuple(path)


# Later steps' reports by their five fields (bounded: batch depths and K values are few in practice).
_LATER_STEPS: dict[tuple[Any, ...], StepReport] = {}
_LATER_STEPS_MAX = 4096


def vllm_step_report(chunk: Mapping[str, Any], k: int) -> StepReport | None:
    """A vLLM server's final usage chunk as a step report: its per-request speculative metrics
    (``--per-request-spec-decode-metrics``), whose histogram counts steps by drafts accepted."""
    metrics = chunk.get("metrics")
    spec = metrics.get("speculative_decoding") if isinstance(metrics, Mapping) else None
    if not isinstance(spec, Mapping):
        return None
    drafted, accepted = spec.get("per_step_drafted"), spec.get("per_step_accepted")
    groups: dict[tuple[int, int], int] = {}
    try:
        if isinstance(drafted, list) and isinstance(accepted, list):  # detailed level: exact per step
            return StepReport(0, 0, 0, 0, 0, group_steps([int(d) for d in drafted], [int(a) for a in accepted]))
        # Summary level: every speculative step of a request drafted min(K, engine K).
        step_k = min(k, int(spec.get("num_spec_tokens", k)))
        for j, count in enumerate(spec.get("acceptance_histogram") or []):
            if int(count) > 0 and step_k > 0:
                groups[(step_k, min(j, step_k))] = groups.get((step_k, min(j, step_k)), 0) + int(count)
    except (TypeError, ValueError):
        return None
    late = tuple(SpecSteps(d, a, c) for (d, a), c in sorted(groups.items()))
    return StepReport(0, 0, 0, 0, 0, late)


def step_log(reports: Iterable[StepReport]) -> dict[str, Any]:
    """A non-streaming answer's ``specgate`` field (``Directive.step_log``): each speculative
    step's [proposed, accepted] in order ([proposed, accepted, tree, path] for a tree step), and
    the [proposed, accepted, count] groups of steps the engine learned late. Plain steps change
    no estimate and are left out."""
    steps: list[list[Any]] = []
    late: list[list[int]] = []
    for report in reports:
        if report.proposed > 0:
            if report.tree is not None and report.path is not None:
                steps.append([report.proposed, report.accepted, report.tree, list(report.path)])
            else:
                steps.append([report.proposed, report.accepted])
        late += [[g.proposed, g.accepted, g.count] for g in report.late_steps]
    out: dict[str, Any] = {"steps": steps}
    if late:
        out["late_steps"] = late
    return out


def logged_steps(raw: Any) -> StepReport | None:
    """``step_log``'s field read back as one report of ``then`` steps (None: absent or malformed)."""
    if not isinstance(raw, dict) or not isinstance(raw.get("steps"), list):
        return None
    try:
        steps = [_logged_step(*step) for step in raw["steps"]]
        late = tuple(SpecSteps(int(p), int(a), int(c)) for p, a, c in raw.get("late_steps") or ())
    except (TypeError, ValueError):
        return None
    return StepReport(0, 0, 0, 0, 0, late, then=tuple(steps))


def _logged_step(proposed: Any, accepted: Any, tree: Any = None, path: Any = None) -> StepReport:
    tree, checked = _tree_path(tree, path)
    return StepReport(int(proposed), int(accepted), 0, int(proposed), 0, tree=tree, path=checked)
