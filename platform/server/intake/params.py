"""Request parameters shared by every generation route (/v1/chat/completions, /v1/completions, /generate):
one set of fields, one set of bounds, one place that turns them into the engine's `SamplingParams`.

Pydantic checks each field's own range (422 naming the field); `SamplingParams.validate` checks what
involves several fields or engine limits (400). Routes differ only in their defaults (OpenAI samples at
temperature 1 by default, the native API is greedy), which they pass in.
"""
from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from loramux.engine.sampling.params import LOGIT_BIAS_LIMIT, SamplingParams
from loramux.engine.sampling.params import MAX_TOP_LOGPROBS as MAX_TOP_LOGPROBS  # for the routes' schemas
from loramux.server.http.bodies import RequestBody
from loramux.server.http.errors import ApiError

MAX_USER_CHARS = 256
MAX_LOGIT_BIAS_ENTRIES = 300  # the engine's limit (SamplingParams.validate)
_TOKEN_ID = re.compile(r"[0-9]{1,10}")
# C0 and C1 control characters and NUL: PostgreSQL text cannot hold NUL, and none belongs in an end-user id.
_CONTROL_CHARS = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def has_control_chars(text: str) -> bool:
    return _CONTROL_CHARS.search(text) is not None


# Content part types that carry an image (OpenAI chat and responses names, and the bare form chat templates use).
IMAGE_PART_TYPES = frozenset({"image_url", "input_image", "image"})


class ContentPart(RequestBody):
    """One part of a message's content. This server's model reads text: only `{"type": "text", "text"}`
    parts are taken; images, audio and files are refused with 400."""

    type: str = Field(description='"text" (other types are refused with 400)')
    text: str | None = None


class ToolCallFunction(RequestBody):
    name: str = Field(min_length=1, max_length=64)
    arguments: str = Field(description="the arguments, as JSON text")


class MessageToolCall(RequestBody):
    """A call an assistant message made (as a response's `message.tool_calls[i]`)."""

    id: str = Field(min_length=1, max_length=64)
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(RequestBody):
    """A chat message. An assistant message may carry the `tool_calls` it made (then `content` may be
    null); a `tool` message answers one of them (`tool_call_id`) with its result in `content`."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = Field(default=None, description="assistant: the calls it made")
    tool_call_id: str | None = Field(default=None, max_length=64, description="tool: the call this answers")

    @model_validator(mode="after")
    def _shape(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (only an assistant message with tool_calls may omit it)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        return self

    def text(self) -> str:
        """The message's text; 400 for a content part this server cannot read."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        for part in self.content:
            if part.type in IMAGE_PART_TYPES:
                raise ApiError(400, f"images are not served (a content part of type {part.type!r}): this server "
                                    "runs the language model only, also of a multimodal checkpoint such as Qwen3.5 "
                                    'or Gemma 3; send the message as text ({"type": "text", "text": ...} parts or a '
                                    "string)", code="unsupported_parameter", param="messages")
            if part.type != "text" or part.text is None:
                raise ApiError(400, f"content parts of type {part.type!r} are not supported: this model reads "
                                    'text only; send {"type": "text", "text": ...} parts or a string',
                               code="unsupported_parameter", param="messages")
        return "".join(p.text for p in self.content)

    def as_template_message(self) -> dict[str, str]:
        """The message as the chat template takes it ("developer" is OpenAI's newer name for "system");
        tool calls and tool results are rendered by `loramux.server.intake.tool_calls.template_messages`."""
        return {"role": "system" if self.role == "developer" else self.role, "content": self.text()}


LogitBias = dict[str, Annotated[float, Field(ge=-LOGIT_BIAS_LIMIT, le=LOGIT_BIAS_LIMIT)]]


def parse_logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's `logit_bias` (token ids as strings of integers -> a bias in [-100, 100]) as the engine's
    {token id: bias}; 400 for a key that is no token id (the engine refuses ids past the vocabulary)."""
    if bias and len(bias) > MAX_LOGIT_BIAS_ENTRIES:  # before looking at any key
        raise ApiError(400, f"logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS_ENTRIES} are accepted",
                       code="too_many_items", param="logit_bias")
    out = {}
    for key, value in (bias or {}).items():
        if not _TOKEN_ID.fullmatch(key):
            raise ApiError(400, f"logit_bias key {key!r} is not a token id: keys are token ids written as strings "
                                'of integers, e.g. {"1234": -100}', code="invalid_logit_bias", param="logit_bias")
        out[int(key)] = float(value)
    return out


class GenerationParams(RequestBody):
    """Sampling and stopping controls: OpenAI's names and ranges, then loramux's extras."""

    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0, description="0 = greedy")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    stream: bool = False
    # loramux extras
    top_k: int = Field(default=0, ge=-1, description="0 or -1 = off")
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0)
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    timeout_s: float | None = Field(default=None, gt=0, le=86_400, description="default: the tier's")
    speculative: bool = Field(default=True, description="allow speculative decoding (prompt lookup, Medusa heads, "
                                                        "a draft model): the same outputs")
    logit_bias: LogitBias | None = Field(
        default=None, description='token id (a string of an integer) -> bias in [-100, 100] added to its logit '
                                  'before sampling; -100 bans a token, +100 all but forces it')
    user: str | None = Field(default=None, max_length=MAX_USER_CHARS,
                             description="your id of the end user, recorded in this request's ledger row")
    metadata: dict[str, Any] | None = Field(
        default=None, description="OpenAI's key-value labels (at most 16, string values); `tags` (a list of strings "
                                  "or a comma-separated string) labels the request for tag budgets and spend "
                                  "reports, like the X-Loramux-Tags header")
    # Parsed by loramux.server.intake.composition (400s naming the entry), not by pydantic (422s).
    adapters: Any = Field(
        default=None, description='combine adapters with weights (then `model` is the base model): '
        '[{"model": "<adapter>", "weight": <number>}, ...]; see docs/tenant-api.md',
        json_schema_extra={"type": "array", "items": {"type": "object", "properties": {
            "model": {"type": "string"}, "weight": {"type": "number"}}, "required": ["model", "weight"]}})

    @field_validator("user")  # (over HTTP a control character is a 400 before this: see body_prechecks)
    @classmethod
    def _user_id(cls, value: str | None) -> str | None:
        """An empty `user` is no user; control characters (NUL included) are refused: the id goes into the
        request's ledger row, which must be writable on every backend."""
        if value is None or value == "":
            return None
        if has_control_chars(value):
            raise ValueError("user must not contain control characters (U+0000-U+001F, U+007F-U+009F)")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_as_list(cls, value) -> list[str]:
        return [value] if isinstance(value, str) else list(value or [])

    def sampling_params(self, max_tokens: int, default_temperature: float, **extra: Any) -> SamplingParams:
        """The engine's parameters; `max_tokens` is already resolved against the context (see below);
        `extra`: more SamplingParams fields a route decides (`structured`, `top_logprobs`)."""
        temperature = default_temperature if self.temperature is None else self.temperature
        logit_bias = parse_logit_bias(self.logit_bias)
        try:
            return SamplingParams(
                max_tokens=max_tokens, min_tokens=min(self.min_tokens, max_tokens), temperature=temperature,
                top_p=self.top_p, top_k=self.top_k, min_p=self.min_p, repetition_penalty=self.repetition_penalty,
                presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty, seed=self.seed,
                stop=self.stop or [], ignore_eos=self.ignore_eos, timeout_s=self.timeout_s,
                speculative=self.speculative, logit_bias=logit_bias, **extra)
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None


def check_prompt_bound(at_least: int, max_model_len: int, exact: bool = False) -> None:
    """Refuse (400 context_length_exceeded) a prompt of at least `at_least` tokens (exactly, with `exact`)
    that leaves no room in the context: before tokenizing with the bound from
    `loramux.server.intake.prompts:Prompt.min_tokens`, after it with the real count."""
    if at_least >= max_model_len:
        raise ApiError(400, f"the prompt has {'' if exact else 'at least '}{at_least} tokens; this model accepts "
                            f"at most {max_model_len - 1} prompt tokens", code="context_length_exceeded")


def check_logprob_volume(n: int, max_tokens: int, per_token: int, limit: int) -> None:
    """Refuse (400 too_many_logprobs) an answer that could hold more than `limit` logprob entries: `n`
    choices of up to `max_tokens` tokens, `per_token` entries each (the token and its top alternatives).
    Such an answer (n=16, top_logprobs=20 at a full context: over 100 MB of JSON) would cost memory and
    encoding time out of proportion to the tokens billed."""
    entries = n * max_tokens * per_token
    if entries > limit:
        raise ApiError(400, f"this request could return {entries} logprob entries (n={n} x max_tokens={max_tokens} "
                            f"x {per_token} per token); this server returns at most {limit} "
                            "(LORAMUX_MAX_LOGPROB_ENTRIES): lower max_tokens, n or top_logprobs",
                       code="too_many_logprobs", param="top_logprobs" if per_token > 1 else "max_tokens")


def resolve_max_tokens(asked: int | None, prompt_len: int, max_model_len: int, default: int) -> int:
    """How many tokens to generate: `asked`, or `default` capped by the room left in the context.
    Refuses (400 context_length_exceeded) a prompt that leaves no room or an `asked` that does not fit."""
    check_prompt_bound(prompt_len, max_model_len, exact=True)
    room = max_model_len - prompt_len
    if asked is None:
        return min(default, room)
    if asked > room:
        raise ApiError(400, f"max_tokens {asked} + the prompt's {prompt_len} tokens exceed the context length "
                            f"{max_model_len}; lower max_tokens to {room} or less", code="context_length_exceeded")
    return asked
