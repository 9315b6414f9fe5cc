"""One request's state as it moves through the engine (torch-free)."""
from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

from loramux.engine.sampling.params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, end-of-turn, stop token or stop string
    LENGTH = "length"  # max_tokens or the model's context length
    TIMEOUT = "timeout"
    CANCELLED = "cancelled"
    ERROR = "error"


@dataclass
class Timings:
    """Wall-clock marks (time.monotonic seconds) and the derived per-request metrics."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None

    def as_dict(self, num_output_tokens: int) -> dict[str, float | None]:
        def ms(a, b):
            return None if a is None or b is None else round((b - a) * 1000, 3)

        decode_s = None if self.first_token is None or self.finished is None else self.finished - self.first_token
        tps = (num_output_tokens - 1) / decode_s if decode_s and num_output_tokens > 1 else None
        return {
            "queue_ms": ms(self.arrival, self.first_scheduled),
            "ttft_ms": ms(self.arrival, self.first_token),
            "total_ms": ms(self.arrival, self.finished),
            "decode_tokens_per_s": None if tps is None else round(tps, 2),
        }


_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    """Tokens, KV blocks and progress of one request.

    `num_computed_tokens` counts tokens whose KV is in the cache; the tokens still to compute are
    `token_ids[num_computed_tokens:]` (several while prefilling, one while decoding). A preempted
    sequence drops its blocks and recomputes prompt + output so far when readmitted.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0  # higher runs first
    tenant: str = ""  # whose request: fair share within a priority level (loramux.engine.scheduling.fair_share)
    share_weight: float = 1.0  # the tenant's weight in that share (its tier's); tokens count 1/weight
    adapter: str | None = None  # adapter key (its content digest), None = base model only
    adapter_leased: bool = False  # running on its adapter (which stays on the device until it ends)
    arrival: float = field(default_factory=time.monotonic)
    deadline: float | None = None  # time.monotonic() value
    seq_id: int = field(default_factory=lambda: next(_ids))
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # when params.top_logprobs
    block_table: list[int] = field(default_factory=list)  # entries may be block_manager.RELEASED (windowed)
    num_released_blocks: int = 0  # leading blocks given back because they left the sliding window
    num_computed_tokens: int = 0
    state_slot: int | None = None  # a hybrid model's per-sequence linear-attention state (block_manager)
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (first admission)
    cache_salt: str = ""  # prefix-cache namespace: adapter version digest (+ tenant when isolated)
    long_rope: bool = False  # LongRoPE: computed with the long factors (see Scheduler's long_rope_after)
    block_hashes: list[bytes] = field(default_factory=list)  # content hashes of the full blocks so far
    draft_token_ids: list[int] = field(default_factory=list)  # speculative tokens to verify this step
    spec_misses: int = 0  # consecutive proposals rejected outright (speculation pauses after a few)
    spec_method: str | None = None  # the proposer of this step's draft (loramux.engine.speculation.speculator)
    spec_counts: dict[str, list[int]] = field(default_factory=dict)  # method -> [proposed, accepted] so far
    medusa_next: list[int] = field(default_factory=list)  # Medusa's proposals for the next step
    medusa_wanted: bool = False  # this step computes medusa_next
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    fair_charged_outputs: int = 0  # output tokens already charged to the tenant's counter
    timings: Timings = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.timings is None:
            self.timings = Timings(arrival=self.arrival)
        if self.deadline is None and self.params.timeout_s is not None:
            self.deadline = self.arrival + self.params.timeout_s

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        return self.num_uncomputed_tokens > 1

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def last_token(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]
