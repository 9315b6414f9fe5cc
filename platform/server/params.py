"""Request parameters shared by every generation route (/v1/chat/completions, /v1/completions, /generate):
one set of fields, one set of bounds, one place that turns them into the engine's `SamplingParams`.

Pydantic checks each field's own range (422 naming the field); `SamplingParams.validate` checks what
involves several fields or engine limits (400). Routes differ only in their defaults (OpenAI samples at
temperature 1 by default, the native API is greedy), which they pass in.
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from loramux.engine.sampling_params import SamplingParams
from loramux.server.bodies import RequestBody
from loramux.server.errors import ApiError


class TextPart(RequestBody):
    type: Literal["text"]
    text: str


class ChatMessage(RequestBody):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def as_template_message(self) -> dict[str, str]:
        """The message as the chat template takes it ("developer" is OpenAI's newer name for "system")."""
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


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
    speculative: bool = Field(default=True, description="allow prompt-lookup speculation (same outputs)")

    @field_validator("stop")
    @classmethod
    def _stop_as_list(cls, value) -> list[str]:
        return [value] if isinstance(value, str) else list(value or [])

    def sampling_params(self, max_tokens: int, default_temperature: float) -> SamplingParams:
        """The engine's parameters; `max_tokens` is already resolved against the context (see below)."""
        temperature = default_temperature if self.temperature is None else self.temperature
        try:
            return SamplingParams(
                max_tokens=max_tokens, min_tokens=min(self.min_tokens, max_tokens), temperature=temperature,
                top_p=self.top_p, top_k=self.top_k, min_p=self.min_p, repetition_penalty=self.repetition_penalty,
                presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty, seed=self.seed,
                stop=self.stop or [], ignore_eos=self.ignore_eos, timeout_s=self.timeout_s,
                speculative=self.speculative)
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None


def check_prompt_bound(at_least: int, max_model_len: int, exact: bool = False) -> None:
    """Refuse (400 context_length_exceeded) a prompt of at least `at_least` tokens (exactly, with `exact`)
    that leaves no room in the context: before tokenizing with the bound from
    `loramux.server.prompts:Prompt.min_tokens`, after it with the real count."""
    if at_least >= max_model_len:
        raise ApiError(400, f"the prompt has {'' if exact else 'at least '}{at_least} tokens; this model accepts "
                            f"at most {max_model_len - 1} prompt tokens", code="context_length_exceeded")


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
