"""Per-request generation controls, validated once at the door (plain Python, no torch)."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Literal

STRUCTURED_KINDS = ("json_object", "json_schema", "regex", "choice")
MAX_TOP_LOGPROBS = 20
LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range for a logit_bias value: [-100, 100]


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on what a request may generate, enforced token by token by a grammar engine
    (`loramux.engine.structured.grammar`). `spec` is canonical text, so equal constraints hash alike (the compile
    cache):

    - "json_object": any JSON object (`spec` unused, "")
    - "json_schema": a JSON schema, `spec` = json.dumps(schema, separators=(",", ":")) (key order kept: the
                     output lists an object's properties in the schema's order)
    - "regex":       the output matches this regular expression in full
    - "choice":      the output is exactly one of a list of strings, `spec` = json.dumps(list_of_strings)

    Generation stops ("stop") as soon as the constraint is complete, and EOS is allowed only then.
    """

    kind: Literal["json_object", "json_schema", "regex", "choice"]
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"structured output kind must be one of {', '.join(STRUCTURED_KINDS)}, got {self.kind!r}")
        if not isinstance(self.spec, str):
            raise ValueError("structured output spec must be text")


@dataclass
class SamplingControls:
    """The sampling controls that a request sets (`SamplingParams`) and that the sampler reads for each of
    its rows (`sampler.SamplingRow`): one definition for both, with the same names and defaults.

    temperature 0 means greedy. top_k 0 (or -1) and top_p 1 and min_p 0 switch those filters off.
    repetition_penalty (HF semantics) covers prompt and output tokens; presence/frequency penalties
    (OpenAI semantics) cover output tokens only. A `seed` makes sampling reproducible whatever else
    shares the batch.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None

    def sampling_controls(self) -> dict:
        """These controls by name, e.g. to build a `SamplingRow` from `SamplingParams`."""
        return {name: getattr(self, name) for name in _CONTROL_NAMES}


_CONTROL_NAMES = tuple(f.name for f in fields(SamplingControls))


@dataclass
class SamplingParams(SamplingControls):
    """How one request samples (the `SamplingControls`) and when it stops.

    Stop strings are removed from the output; `timeout_s` sets a deadline measured from arrival, after
    which the request ends with finish_reason "timeout" and its partial output.
    """

    max_tokens: int = 256
    min_tokens: int = 0  # EOS and stop token ids (not stop strings) are suppressed until this many exist
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    timeout_s: float | None = None
    speculative: bool = True  # allow prompt-lookup speculation (when the engine has it on); same outputs
    structured: StructuredOutput | None = None  # constrain the output (JSON, schema, regex, choice)
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit (OpenAI)
    top_logprobs: int = 0  # also report this many most likely tokens (raw log-softmax) at each position

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the parameter and the accepted range."""
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(msg)

        need(isinstance(self.max_tokens, int) and self.max_tokens >= 1,
             f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        need(isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
             f"min_tokens must be an integer in [0, max_tokens], got {self.min_tokens!r}")
        need(0.0 <= self.temperature <= 100.0, f"temperature must be in [0, 100], got {self.temperature}")
        need(isinstance(self.top_k, int) and self.top_k >= -1,
             f"top_k must be -1, 0 (off) or a positive integer, got {self.top_k!r}")
        need(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        need(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        need(0.0 < self.repetition_penalty <= 10.0,
             f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}")
        need(-2.0 <= self.presence_penalty <= 2.0, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        need(-2.0 <= self.frequency_penalty <= 2.0,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        need(self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 2**63),
             f"seed must be an integer in [0, 2^63), got {self.seed!r}")
        need(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
             "stop_token_ids must be non-negative token ids")
        need(len(self.stop) <= 16, f"at most 16 stop strings, got {len(self.stop)}")
        need(all(isinstance(s, str) and 0 < len(s) <= 256 for s in self.stop),
             "each stop string must be a non-empty string of at most 256 characters")
        need(self.timeout_s is None or self.timeout_s > 0, f"timeout_s must be > 0, got {self.timeout_s}")
        need(self.structured is None or isinstance(self.structured, StructuredOutput),
             "structured must be a StructuredOutput")
        need(isinstance(self.logit_bias, dict) and len(self.logit_bias) <= 300,
             "logit_bias must map at most 300 token ids to biases")
        need(all(isinstance(t, int) and t >= 0 for t in self.logit_bias),
             "logit_bias keys must be non-negative token ids")
        need(all(isinstance(b, (int, float)) and -LOGIT_BIAS_LIMIT <= b <= LOGIT_BIAS_LIMIT
                 for b in self.logit_bias.values()),
             f"logit_bias values must be numbers in [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}]")
        need(isinstance(self.top_logprobs, int) and 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS,
             f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs!r}")
