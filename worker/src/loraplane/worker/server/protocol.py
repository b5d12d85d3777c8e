"""Request and response bodies of the worker HTTP API (SGLang / OpenAI names)."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from loraplane.rules.names import LORA_NAME_PATTERN
from loraplane.rules.text import check_text
from loraplane.worker.engine.logprobs import MAX_TOP_LOGPROBS


class _Body(BaseModel):
    """A request body: numbers are finite (``NaN``/``Infinity`` are refused by name), nothing
    is coerced (``"yes"`` is no boolean, ``"5"`` no number), a field the endpoint does not
    have is refused by name (a misspelt parameter is never silently ignored), and every string
    is Unicode text."""

    model_config = ConfigDict(allow_inf_nan=False, strict=True, extra="forbid")

    @field_validator("*", mode="after")
    @classmethod
    def _unicode(cls, value: Any) -> Any:
        return check_text(value)


# --- fields this worker does not implement -------------------------------------------------

# A field of the OpenAI or SGLang API the worker does not implement is declared (so it is in
# the schema) and refused with 400 naming it when given anything but its neutral value; it is
# never silently ignored.

# Log probabilities (`engine.logprobs`) are those of the model's own distribution (before
# temperature, top-k and top-p), with at most MAX_TOP_LOGPROBS alternatives per token.


def _unsupported(what: str) -> Any:
    return Field(default=None, description=f"not supported ({what}): refused unless neutral")


class _Refusing(_Body):
    # field -> the values that ask for nothing (the field is then accepted and ignored)
    NEUTRAL: ClassVar[dict[str, tuple[Any, ...]]] = {}

    def unsupported(self) -> tuple[str, Any] | None:
        """The first field set to something this worker does not do, with its value."""
        for name, neutral in self.NEUTRAL.items():
            value = getattr(self, name)
            if value is not None and not any(
                value == n and type(value) is type(n) for n in neutral
            ):
                return name, value
        return None


_PENALTIES: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "logit_bias": ({},),
}


# --- sampling, shared ----------------------------------------------------------------------


class _Sampling(_Body):
    temperature: float | None = Field(
        default=None, ge=0, le=100, description="0 (or below 1e-5) = greedy"
    )
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1, description="-1 or 0 = no limit")
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False


# --- SGLang /generate ----------------------------------------------------------------------


class GenerateSamplingParams(_Sampling, _Refusing):
    NEUTRAL: ClassVar[dict[str, tuple[Any, ...]]] = {
        "presence_penalty": (0, 0.0),
        "frequency_penalty": (0, 0.0),
        "repetition_penalty": (1, 1.0),
        "min_new_tokens": (0,),
        "n": (1,),
        "regex": (),
        "json_schema": (),
        "ebnf": (),
    }
    max_new_tokens: int = Field(default=128, ge=0)
    presence_penalty: Any = _unsupported("penalties")
    frequency_penalty: Any = _unsupported("penalties")
    repetition_penalty: Any = _unsupported("penalties")
    min_new_tokens: Any = _unsupported("a minimum length")
    n: Any = _unsupported("only one sequence per request")
    regex: Any = _unsupported("constrained decoding")
    json_schema: Any = _unsupported("constrained decoding")
    ebnf: Any = _unsupported("constrained decoding")


class GenerateRequest(_Refusing):
    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: GenerateSamplingParams = Field(default_factory=GenerateSamplingParams)
    lora_path: str | None = Field(
        default=None, description="adapter name (SGLang calls it lora_path)"
    )
    stream: bool = False
    rid: str | None = None
    return_logprob: bool = Field(
        default=False, description="log probabilities of the prompt and output tokens"
    )
    top_logprobs_num: int = Field(
        default=0, ge=0, le=MAX_TOP_LOGPROBS, description="alternatives per token"
    )
    logprob_start_len: int = Field(
        default=-1,
        ge=-1,
        description="first prompt position with input logprobs; -1: the prompt's last token",
    )
    return_text_in_logprobs: bool = Field(
        default=False, description="each logprob entry with its token's text"
    )


class FinishReason(BaseModel):
    type: Literal["stop", "length", "abort"]
    matched: int | str | None = None


# (logprob, token id, token text or null); the first prompt token's logprob is null
LogprobTriple = tuple[float | None, int, str | None]


class GenerateMetaInfo(BaseModel):
    id: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: FinishReason | None = None
    # with return_logprob (absent otherwise)
    input_token_logprobs: list[LogprobTriple] | None = None
    output_token_logprobs: list[LogprobTriple] | None = None
    # with return_logprob and top_logprobs_num > 0: per position, its most likely tokens
    input_top_logprobs: list[list[LogprobTriple] | None] | None = None
    output_top_logprobs: list[list[LogprobTriple] | None] | None = None


class GenerateResponse(BaseModel):
    text: str
    output_ids: list[int]
    meta_info: GenerateMetaInfo


# --- OpenAI completions -------------------------------------------------------------------


class StreamOptions(_Body):
    """OpenAI's ``stream_options``: accepted; a stream's last chunk always carries ``usage``."""

    model_config = ConfigDict(extra="allow")
    include_usage: bool | None = None


class CompletionRequest(_Sampling, _Refusing):
    NEUTRAL: ClassVar[dict[str, tuple[Any, ...]]] = {
        "n": (1,),
        "best_of": (1,),
        "suffix": ("",),
        **_PENALTIES,
    }
    model: str | None = None
    prompt: str | list[int]
    max_tokens: int | None = Field(default=16, ge=0, description="null: 16, as OpenAI's")
    n: Any = Field(default=1, description="only 1 is supported")
    stream: bool = False
    stream_options: StreamOptions | None = None
    lora_path: str | None = None
    user: str | None = None
    logprobs: int | None = Field(
        default=None,
        ge=0,
        le=MAX_TOP_LOGPROBS,
        description="log probabilities of the tokens, with this many alternatives each",
    )
    echo: bool = Field(
        default=False,
        description="the prompt before the completion (its tokens' logprobs with `logprobs`)",
    )
    best_of: Any = _unsupported("only one sequence per request")
    suffix: Any = _unsupported("insertion")
    presence_penalty: Any = _unsupported("penalties")
    frequency_penalty: Any = _unsupported("penalties")
    logit_bias: Any = _unsupported("logit bias")


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None] = Field(description="null for the prompt's first token")
    top_logprobs: list[dict[str, float] | None] = Field(
        description="per token, its most likely alternatives and the token itself"
    )
    text_offset: list[int] = Field(description="each token's first character in the text")


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None
    matched_stop: int | str | None = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ContentPart(_Body):
    model_config = ConfigDict(extra="allow")
    type: str = Field(description="only text parts are supported")
    text: str | None = None


class ChatMessage(_Body):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] = Field(
        description="a string, or a list of text parts (joined with newlines)"
    )


class ChatCompletionRequest(_Sampling, _Refusing):
    NEUTRAL: ClassVar[dict[str, tuple[Any, ...]]] = {
        "n": (1,),
        "tools": ([],),
        "tool_choice": ("none",),
        "functions": ([],),
        "function_call": ("none",),
        "response_format": ({"type": "text"},),
        **_PENALTIES,
    }
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=0)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    n: Any = Field(default=1, description="only 1 is supported")
    stream: bool = False
    stream_options: StreamOptions | None = None
    lora_path: str | None = None
    user: str | None = None
    logprobs: bool | None = Field(
        default=None, description="log probabilities of the completion's tokens"
    )
    top_logprobs: int | None = Field(
        default=None,
        ge=0,
        le=MAX_TOP_LOGPROBS,
        description="alternatives per token; needs `logprobs: true`",
    )
    tools: Any = _unsupported("tool calls")
    tool_choice: Any = _unsupported("tool calls")
    functions: Any = _unsupported("tool calls")
    function_call: Any = _unsupported("tool calls")
    response_format: Any = _unsupported("constrained decoding")
    presence_penalty: Any = _unsupported("penalties")
    frequency_penalty: Any = _unsupported("penalties")
    logit_bias: Any = _unsupported("logit bias")


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = Field(description="the token's text as UTF-8")


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None
    matched_stop: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


# --- adapters ------------------------------------------------------------------------------


class LoadLoRAAdapterRequest(_Body):
    lora_name: str = Field(min_length=1, max_length=200, pattern=LORA_NAME_PATTERN)
    lora_path: str = Field(min_length=1, max_length=4096)
    pinned: bool = False
    evict: list[Annotated[str, Field(min_length=1, max_length=200)]] = Field(
        default_factory=list,
        max_length=64,
        description="adapters to unload to make room, once the new one has been read on every "
        "DP group: a load that fails evicts none (one not loaded is skipped, a pinned one refused)",
    )

    @field_validator("lora_path")
    @classmethod
    def _a_path(cls, value: str) -> str:
        if "\x00" in value:
            raise ValueError(f"holds a NUL character at {value.index(chr(0))}, which no path can")
        return value


class UnloadLoRAAdapterRequest(_Body):
    lora_name: str = Field(min_length=1, max_length=200)


class LoRAUpdateResponse(BaseModel):
    success: bool
    error_message: str = ""
    loaded_adapters: dict[str, str] = Field(
        default_factory=dict, description="adapter name -> path"
    )


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "loraplane"
    root: str
    parent: str | None = None
    max_model_len: int | None = None
    pinned: bool | None = None
    inconsistent: bool | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class HealthResponse(BaseModel):
    status: Literal["ok"]


class DPGroupState(BaseModel):
    dp_group: int
    adapters: list[str]
    slots_used: int
    slots_total: int
    running: int
    kv_pages_used: int = Field(description="KV pages held by running requests")
    kv_pages_cached: int = Field(description="KV pages of cached prefixes no request holds")
    kv_pages_total: int


class AdapterState(BaseModel):
    name: str
    key: str
    version: int
    path: str
    pinned: bool
    slot: int | None
    retired: bool
    running: int
    last_used: int


class PrefixCacheState(BaseModel):
    adapter: str | None = Field(description="the adapter name; null for the base model")
    hits: int = Field(description="admitted requests that found a cached prefix")
    misses: int
    cached_tokens: int = Field(description="prompt tokens whose prefill was skipped")
    prompt_tokens: int


class EvictionRecord(BaseModel):
    adapter: str
    at: float


class LoRAStateResponse(BaseModel):
    max_loras_per_batch: int
    max_loaded_loras: int
    loaded: int
    pinned: list[str]
    inconsistent: list[str]
    slots: list[str | None] = Field(description="adapter key in each GPU slot")
    lru_order: list[str] = Field(description="keys holding a slot, least recently used first")
    dp_groups: list[DPGroupState]
    adapters: list[AdapterState]
    evictions: list[EvictionRecord]
    prefix_cache: list[PrefixCacheState]
    waiting: int
    running: int


class FaultRequest(_Body):
    op: Literal["load", "unload"]
    dp_group: int = Field(ge=0)
    count: int = Field(default=1, ge=0)
    message: str = ""


class FaultResponse(BaseModel):
    armed: dict[str, Any]


class ErrorDetail(BaseModel):
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorDetail
