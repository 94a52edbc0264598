"""The public OpenAI API as pydantic models: what a request may hold, what a response looks like.

``protocol.parse_request`` validates every request with ``CompletionBody`` or
``ChatCompletionBody``, and ``gateway/relay/openapi.py`` builds ``GET /openapi.json`` from these
same classes, so the document and the validation cannot drift apart.

Every OpenAI parameter is one of three things here (README lists them):
- supported: it changes the output, and the engine implements it;
- accepted at its default only: the engine does not implement it, so the model types it to
  accept just the value that asks for nothing (``n: 1``, ``logprobs: false``, ``tools: []``...),
  which SDKs send routinely, and anything else is a 400 that names it (``DEFAULT_ONLY``);
- accepted and ignored: bookkeeping with no effect on the output (``user``, ``metadata``...).
Anything else is refused as an unrecognized argument, as OpenAI does: a parameter silently
ignored would be a wrong answer that looks right.

Models are strict (no "1" for 1, no true for 1) and forbid unknown fields. Response models
are lenient (extra fields allowed), since they only document what the server sends.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator
from pydantic.json_schema import SkipJsonSchema

from policies.methods import Method
from policies.tree import TreeShapeError, parse_shape
from workers.api.wire import MAX_CACHE_SALT, cache_salt_problem

MAX_STOP_SEQUENCES = 4
MAX_TOKENS_LIMIT = 1 << 20  # beyond any context window; the worker checks the real one
MAX_TOKEN_ID = (1 << 31) - 1  # the worker checks the vocabulary
MAX_TOP_K = 1 << 20  # top_k at or above the vocabulary size keeps every token
MAX_METADATA_KEYS = 16
MAX_TEMPERATURE = 2
MAX_DIRECTIVE_K = 64
MAX_DIRECTIVE_COUNT = 1 << 20  # a directive's batch depths and drafts per step
MAX_COALESCE_S = 60
MAX_TREE_TEXT = 40  # characters of a directive's tree notation


def _tree_shape(value: str) -> str:
    """A tree shape's notation, checked (policies/tree.py bounds it)."""
    try:
        parse_shape(value)
    except TreeShapeError as exc:
        raise ValueError(str(exc)) from None
    return value


def _cache_salt(value: str) -> str:
    problem = cache_salt_problem(value)
    if problem is not None:
        raise ValueError(problem)
    return value


def _false(value: bool) -> bool:
    if value:
        raise ValueError("only false is accepted")
    return value


# -- field types ---------------------------------------------------------------------------------
TokenIds = Annotated[list[Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]], Field(min_length=1)]
MaxTokens = Annotated[int, Field(ge=1, le=MAX_TOKENS_LIMIT)]
Temperature = Annotated[float, Field(ge=0, le=MAX_TEMPERATURE, allow_inf_nan=False,
                                     description="0 is greedy; below 1e-5 counts as 0")]
TopP = Annotated[float, Field(gt=0, le=1, allow_inf_nan=False,
                              description="nucleus mass kept; 0 would keep no token")]
TopK = Annotated[int, Field(ge=-1, le=MAX_TOP_K, description="vLLM's extension; -1 or 0 keeps every token")]
Seed = Annotated[int, Field(ge=-(1 << 63), le=(1 << 63) - 1)]
StopString = Annotated[str, Field(min_length=1)]
Stop = StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_SEQUENCES)]
# Accepted at the one value that asks for nothing (see DEFAULT_ONLY).
OnlyOne = Annotated[int, Field(ge=1, le=1)]
OnlyZero = Annotated[int, Field(ge=0, le=0)]
OnlyZeroNumber = Annotated[float, Field(ge=0, le=0)]
OnlyOneNumber = Annotated[float, Field(ge=1, le=1)]
OnlyFalse = Annotated[bool, AfterValidator(_false), Field(json_schema_extra={"const": False})]
NoList = Annotated[list[Any], Field(max_length=0)]
NoMap = Annotated[dict[str, Any], Field(max_length=0)]
NoText = Annotated[str, Field(max_length=0)]
CacheSalt = Annotated[str, AfterValidator(_cache_salt),
                      Field(min_length=1, max_length=MAX_CACHE_SALT, pattern=r"^[^@/\\\x00]+$")]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool | None = None
    include_obfuscation: bool | None = Field(None, description="accepted and ignored")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant"] = Field(description="developer is treated as system")
    content: str | list[TextPart] = Field(description="a string or text content parts")
    name: str | None = Field(None, description="accepted and ignored")
    # Fields an SDK echoes back when a previous response message is sent again: only empty values.
    refusal: None = None
    tool_calls: NoList | None = None
    function_call: None = None
    audio: None = None
    annotations: NoList | None = None


class ResponseFormatText(_Strict):
    type: Literal["text"]


class Resume(_Strict):
    """Continue a generation another worker began (gateway/relay/migration.py): the prompt's token
    ids, the output tokens generated so far, and how many characters of their text the client
    already has. The worker skips templating and tokenizing and goes on from prompt + output."""

    prompt_ids: TokenIds
    output_ids: list[Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]]
    text_sent: Annotated[int, Field(ge=0)] = 0


class Directive(_Strict):
    """The gateway's ``specgate`` directive to its workers (not part of the public API)."""

    k: Annotated[int, Field(ge=0, le=MAX_DIRECTIVE_K)] = 0
    max_batch: Annotated[int, Field(ge=1, le=MAX_DIRECTIVE_COUNT)] = MAX_DIRECTIVE_COUNT
    batch_resume: Annotated[int, Field(ge=1, le=MAX_DIRECTIVE_COUNT)] = MAX_DIRECTIVE_COUNT
    max_step_drafts: Annotated[int, Field(ge=0, le=MAX_DIRECTIVE_COUNT)] = 0  # 0: no limit
    resume: Resume | None = None
    cost_rule: bool = False  # policy K auto: the worker's per-step rule consults its cost model
    # A non-streaming request's chunks, this long as one.
    coalesce_s: Annotated[float, Field(ge=0, le=MAX_COALESCE_S)] = 0.0
    whole_answer: bool = False  # with coalesce_s: a first span that ends the answer may come whole
    step_log: bool = False  # a non-streaming answer lists its steps' drafts (the endpoint picker's feedback)
    # A token tree instead of a chain of k (policies/tree.py's notation, "2x2+3"); k is its depth.
    tree: Annotated[str, Field(max_length=MAX_TREE_TEXT), AfterValidator(_tree_shape)] | None = None
    # A lookup method proposes instead of the draft model (policies/methods.py); None: the draft.
    method: Method | None = None

    @model_validator(mode="after")
    def _tree_depth(self) -> Directive:
        if self.tree is not None and (depth := parse_shape(self.tree).depth) != self.k:
            raise ValueError(f"a tree's k is its depth ({depth} for {self.tree}; "
                             f"got k={self.k})")
        if self.tree is not None and self.method not in (None, "draft"):
            raise ValueError(f"a token tree is drafted by the draft model, not {self.method}")
        return self


class _RequestBody(_Strict):
    model: Annotated[str, Field(min_length=1)]
    max_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    seed: Seed | None = None
    stop: Stop | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, description="the session key when X-Session-ID is absent")
    n: OnlyOne | None = None
    presence_penalty: OnlyZeroNumber | None = None
    frequency_penalty: OnlyZeroNumber | None = None
    logit_bias: NoMap | None = None
    # vLLM's sampling extensions, at their neutral values.
    min_p: OnlyZeroNumber | None = None
    repetition_penalty: OnlyOneNumber | None = None
    ignore_eos: bool | None = Field(None, description="vLLM's: generate to max_tokens, whatever EOS the model "
                                                      "samples (stop strings still end it)")
    min_tokens: Annotated[int, Field(ge=0, le=MAX_TOKENS_LIMIT)] | None = Field(
        None, description="vLLM's: no EOS before this many output tokens, and no stop string matched before them")
    cache_salt: CacheSalt | None = Field(
        None, description="vLLM's: requests with different salts never share cached prompt blocks (nor, here, "
                          "lookup memory); scoped within the caller's tenant")
    # Set by the gateway for its workers; refused from clients (gateway/relay/relay.py).
    specgate: SkipJsonSchema[Directive | None] = None
    vllm_xargs: SkipJsonSchema[dict[str, Any] | None] = None


class CompletionBody(_RequestBody):
    """``POST /v1/completions``: one prompt (a batch of one is accepted)."""

    prompt: (str | Annotated[list[str], Field(min_length=1, max_length=1)] | TokenIds
             | Annotated[list[TokenIds], Field(min_length=1, max_length=1)])
    echo: OnlyFalse | None = None
    best_of: OnlyOne | None = None
    logprobs: None = None
    suffix: NoText | None = None


class ChatCompletionBody(_RequestBody):
    """``POST /v1/chat/completions``: text messages."""

    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: MaxTokens | None = Field(None, description="wins over max_tokens")
    logprobs: OnlyFalse | None = None
    top_logprobs: OnlyZero | None = None
    response_format: ResponseFormatText | None = None
    tools: NoList | None = None
    tool_choice: Literal["none"] | None = None
    parallel_tool_calls: bool | None = Field(None, description="accepted and ignored: there are no tools")
    functions: NoList | None = None
    function_call: Literal["none"] | None = None
    modalities: Annotated[list[Literal["text"]], Field(max_length=1)] | None = None
    audio: None = None
    prediction: None = None
    reasoning_effort: None = None
    verbosity: None = None
    web_search_options: None = None
    store: OnlyFalse | None = None
    metadata: Annotated[dict[str, str], Field(max_length=MAX_METADATA_KEYS)] | None = Field(
        None, description="accepted and ignored")
    service_tier: Literal["auto", "default"] | None = Field(None, description="accepted and ignored: one tier")
    prompt_cache_key: str | None = Field(None, description="accepted and ignored")
    safety_identifier: str | None = Field(None, description="accepted and ignored")


class TokenizeCompletionBody(_Strict):
    """``POST /tokenize``, vLLM's completion form: a prompt as ``/v1/completions`` encodes it."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatBody(_Strict):
    """``POST /tokenize``, vLLM's chat form: messages rendered by the model's chat template."""

    model: str | None = None
    messages: Annotated[list[Message], Field(min_length=1)]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool = False
    # vLLM refuses a request's own template unless started with --trust-request-chat-template.
    chat_template: None = Field(None, description="not accepted: the model's own template renders")
    chat_template_kwargs: Annotated[dict[str, Any], Field(max_length=0)] | None = None
    tools: NoList | None = None


class DetokenizeBody(_Strict):
    """``POST /detokenize``: token ids back to text (special tokens included, as vLLM decodes)."""

    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]]


# Parameters accepted at their default only, with the default(s) a 400 names.
DEFAULT_ONLY: dict[str, str] = {
    "n": "1", "best_of": "1", "echo": "false", "logprobs": "false or null", "top_logprobs": "0", "suffix": '""',
    "logit_bias": "{}", "presence_penalty": "0", "frequency_penalty": "0", "min_p": "0", "repetition_penalty": "1",
    "tools": "[]", "functions": "[]", "tool_choice": '"none"',
    "function_call": '"none"', "response_format": '{"type": "text"}', "modalities": '["text"]', "audio": "null",
    "prediction": "null", "reasoning_effort": "null", "verbosity": "null", "web_search_options": "null",
    "store": "false", "service_tier": '"auto" or "default"', "refusal": "null", "tool_calls": "[]",
    "annotations": "[]",
}
# Parameters accepted and ignored (no effect on the output).
IGNORED = ("user", "metadata", "parallel_tool_calls", "prompt_cache_key", "safety_identifier",
           "stream_options.include_obfuscation", "messages[].name")
# Field names of the request models (to tell them from pydantic's union-member labels in an error's loc).
FIELD_NAMES = frozenset().union(*(m.model_fields for m in (
    CompletionBody, ChatCompletionBody, Message, TextPart, StreamOptions, ResponseFormatText, Directive,
    TokenizeCompletionBody, TokenizeChatBody, DetokenizeBody)))


# -- responses (documentation only: the server builds these as dicts) --------------------------------
class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class SpeculativeUsage(BaseModel):
    proposed: int = Field(description="drafts proposed")
    accepted: int = Field(description="drafts accepted")
    tested: int | None = Field(None, description="drafts tested (the accepted ones and each step's first rejected "
                                                 "one): accepted / tested is the per-draft acceptance the policy reads")
    acceptance_rate: float | None = Field(description="vLLM's accepted / proposed; null when nothing was proposed")
    mode: Literal["speculative", "plain"]


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="prompt tokens served from the worker's prefix cache, not prefilled")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    speculative: SpeculativeUsage | None = None
    # OpenAI's field; only from engines that report their prefix-cache hits (the sim).
    prompt_tokens_details: PromptTokensDetails | None = None


FinishReason = Literal["stop", "length"]


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: FinishReason | None
    logprobs: None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: FinishReason | None
    logprobs: None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok"]


class Ready(BaseModel):
    status: Literal["ready"]
    workers_ready: int
    workers: int
