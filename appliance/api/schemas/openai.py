"""The OpenAI API's request bodies (appliance/api/openai.py): chat completions, completions,
embeddings; and the bodies of its answers that /openapi.json describes.

Every field a request may carry is declared here; one that is not is refused ("Unrecognized
request argument supplied", OpenAI's words). Fields this server cannot honour are declared
with their default as the only value (``echo``, ``best_of``...), so a client that sends the
default is served. vLLM's, llama.cpp's and Ollama's extensions (``top_k``, ``min_p``,
``repetition_penalty``: the openai client's ``extra_body``) are declared beside OpenAI's.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from appliance.api.schemas import error
from appliance.core.sampling import MAX_TOP_LOGPROBS

MAX_STOPS = 4  # OpenAI's limit
MAX_CHOICES = 8  # n: each choice is a stream (and a cache row) of its own
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit for /v1/completions logprobs
MAX_LOGIT_BIAS = 300  # OpenAI's limit on logit_bias entries
INT64 = 1 << 63

Penalty = Annotated[float, error("must be a number from -2 to 2", ge=-2, le=2)]
TokenId = Annotated[str, msgspec.Meta(pattern=r"^[0-9]+$")]
Bias = Annotated[float, msgspec.Meta(ge=-100, le=100)]
_NOT_HONOURED = "is not supported by this server (only its default {})"


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    include_usage: bool | None = None


class JsonSchemaFormat(msgspec.Struct, omit_defaults=True):
    """``response_format.json_schema``: the answer is a JSON document valid against ``schema``."""

    schema: dict[str, Any]
    name: str = ""
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class Function(msgspec.Struct, omit_defaults=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema of the arguments
    strict: bool | None = None


class Tool(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["function"]
    function: Function


class FunctionName(msgspec.Struct):
    name: str


class NamedToolChoice(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["function"]
    function: FunctionName


class CalledFunction(msgspec.Struct, omit_defaults=True):
    name: str
    arguments: str | dict[str, Any] = "{}"  # OpenAI sends a JSON text; an object is taken too


class ToolCall(msgspec.Struct, omit_defaults=True):
    function: CalledFunction
    id: str | None = None
    type: Literal["function"] = "function"


class TextPart(msgspec.Struct, forbid_unknown_fields=True):
    """A content part: text only (this server's models take text)."""

    type: Literal["text"]
    text: str


class Message(msgspec.Struct, omit_defaults=True):
    """A chat message. Fields OpenAI has beyond these (``refusal``, ``audio``...) are ignored."""

    role: str
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class _Request(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """What chat completions and completions share."""

    model: Annotated[str, error("must be the name of a model that generates (GET /v1/models)", min_length=1,
                                description="name, name:<version> or name:<label>")]
    max_tokens: Annotated[int, error("must be an integer from 1 to 2**62", ge=1, le=1 << 62)] | None = None
    temperature: Annotated[float, error("must be a number from 0 to 2", ge=0, le=2)] | None = None
    top_p: Annotated[float, error("must be a number above 0, at most 1", gt=0, le=1)] | None = None
    stop: Annotated[str, error(f"must be a string or a list of at most {MAX_STOPS} strings")] | \
        Annotated[list[str], msgspec.Meta(max_length=MAX_STOPS)] | None = None
    seed: Annotated[int, error("must be a 64-bit integer", ge=-INT64, le=INT64 - 1)] | None = None
    n: Annotated[int, error(f"must be an integer from 1 to {MAX_CHOICES}", ge=1, le=MAX_CHOICES)] | None = None
    stream: Annotated[bool, error("must be true or false")] | None = None
    stream_options: Annotated[StreamOptions, error("takes only include_usage")] | None = None
    user: Annotated[str, error("must be a string (it is ignored)")] | None = None
    response_format: Annotated[ResponseFormat, error(
        "must be {\"type\": \"text\" | \"json_object\" | \"json_schema\"}")] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: Annotated[dict[TokenId, Bias], error(
        f"must be an object of at most {MAX_LOGIT_BIAS} token ids to biases from -100 to 100",
        max_length=MAX_LOGIT_BIAS)] | None = None
    top_k: Annotated[int, error("must be an integer from -1 (off) to 2**31", ge=-1, le=1 << 31)] | None = None
    min_p: Annotated[float, error("must be a number from 0 to 1", ge=0, le=1)] | None = None
    repetition_penalty: Annotated[float, error("must be a number above 0, at most 100", gt=0, le=100)] | None = None
    # OpenAI's, which this server cannot honour: only their default is taken
    echo: Annotated[Literal[False], error(_NOT_HONOURED.format(False))] | None = None
    best_of: Annotated[Literal[1], error(
        "is not supported by this server (best_of (ranking several samples by their log-probability) is not "
        "built here; ask for n choices and compare their logprobs)")] | None = None
    suffix: Annotated[Literal[""], error(_NOT_HONOURED.format("''"))] | None = None
    store: Annotated[Literal[False], error(_NOT_HONOURED.format(False))] | None = None
    metadata: Annotated[dict[str, str], error(_NOT_HONOURED.format({}), max_length=0)] | None = None
    service_tier: Annotated[Literal["auto", "default"], error(_NOT_HONOURED.format("'auto'"))] | None = None


class ChatRequest(_Request, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[Message], error("must be a non-empty list of messages {role, content}, content a "
                                             "string or text parts (these models take text only)", min_length=1)]
    max_completion_tokens: Annotated[int, error("must be an integer from 1 to 2**62", ge=1,
                                                le=1 << 62)] | None = None
    logprobs: Annotated[bool, error("must be true or false")] | None = None
    top_logprobs: Annotated[int, error(f"must be an integer from 0 to {MAX_TOP_LOGPROBS}", ge=0,
                                       le=MAX_TOP_LOGPROBS)] | None = None
    tools: Annotated[list[Tool], error("must be a list of {\"type\": \"function\", \"function\": {\"name\", "
                                       "\"parameters\"}}")] | None = None
    tool_choice: Annotated[Literal["none", "auto", "required"], error(
        "must be none, auto, required or {\"type\": \"function\", \"function\": {\"name\"}}")] \
        | NamedToolChoice | None = None
    parallel_tool_calls: Annotated[bool, error("must be true or false")] | None = None


class CompletionRequest(_Request, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """``POST /v1/completions``: one prompt per request."""

    prompt: Annotated[str, error("must be a non-empty string (one prompt per request)", min_length=1)] | \
        Annotated[list[Annotated[str, msgspec.Meta(min_length=1)]], msgspec.Meta(min_length=1, max_length=1)]
    logprobs: Annotated[int, error(f"must be an integer from 0 to {MAX_COMPLETION_LOGPROBS}", ge=0,
                                   le=MAX_COMPLETION_LOGPROBS)] | Literal[False] | None = None


class EmbeddingRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """``POST /v1/embeddings``: texts, or token-id lists for an ``input_ids`` encoder."""

    model: Annotated[str, error("is required: an encoder model (GET /v1/models)", min_length=1)]
    input: Annotated[str, error("must be a non-empty string, a list of them, or token-id lists", min_length=1)] | \
        Annotated[list[str | int | list[int]], msgspec.Meta(min_length=1)]
    encoding_format: Annotated[Literal["float", "base64"], error("must be float or base64")] | None = None
    dimensions: Annotated[int, error("must be a positive integer", ge=1)] | None = None
    user: str | None = None


# -- answers (no defaults: every field is always written, so /openapi.json lists each as required)
class Model(msgspec.Struct):
    id: str
    created: int
    owned_by: str
    object: Literal["model"]


class ModelList(msgspec.Struct):
    data: list[Model]
    object: Literal["list"]


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]  # the token's own bytes (a character split across tokens too)


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[TokenLogprob]
    refusal: None


class FunctionCalled(msgspec.Struct):
    name: str
    arguments: str  # the arguments object's text, as the model generated it


class ToolCallMade(msgspec.Struct):
    id: str
    function: FunctionCalled
    type: Literal["function"]


class AssistantMessage(msgspec.Struct, omit_defaults=True):
    content: str | None
    refusal: None
    role: Literal["assistant"]
    tool_calls: list[ToolCallMade] | msgspec.UnsetType = msgspec.UNSET


class ChatChoice(msgspec.Struct):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length", "tool_calls"] | None


class ChatCompletion(msgspec.Struct):
    """The answer of ``POST /v1/chat/completions`` without ``stream``."""

    id: str
    created: int
    model: str  # the version that answered, name:<version>
    choices: list[ChatChoice]
    usage: Usage
    object: Literal["chat.completion"]


class CompletionLogprobs(msgspec.Struct):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length"] | None


class TextCompletion(msgspec.Struct):
    """The answer of ``POST /v1/completions`` without ``stream``."""

    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    object: Literal["text_completion"]


class Embedding(msgspec.Struct):
    index: int
    embedding: list[float] | str  # str: base64 of little-endian float32 (encoding_format base64)
    object: Literal["embedding"]


class EmbeddingUsage(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(msgspec.Struct):
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
    object: Literal["list"]


class OpenAIErrorObject(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class OpenAIError(msgspec.Struct):
    """OpenAI's error, or the service's ``{"error": "..."}`` (the layers in front of every API)."""

    error: OpenAIErrorObject | str


REQUESTS = (ChatRequest, CompletionRequest, EmbeddingRequest)
ANSWERS = (ChatCompletion, TextCompletion, EmbeddingList, ModelList, OpenAIError)

__all__ = ["ANSWERS", "ChatCompletion", "ChatRequest", "CompletionRequest", "EmbeddingList", "EmbeddingRequest",
           "MAX_CHOICES", "MAX_COMPLETION_LOGPROBS", "MAX_LOGIT_BIAS", "MAX_STOPS", "Message", "ModelList", "OpenAIError",
           "REQUESTS", "TextCompletion", "Tool"]
