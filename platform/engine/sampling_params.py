"""Per-request generation controls, validated once at the door (plain Python, no torch)."""
from __future__ import annotations

from dataclasses import dataclass, field, fields


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
