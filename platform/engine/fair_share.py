"""Fair share between the tenants of one tier: a virtual token counter per tenant (torch-free).

The Virtual Token Counter of S-LoRA's authors (Sheng et al., "Fairness in Serving Large Language Models",
OSDI'24), adapted to this scheduler:

- Each tenant has a counter of the service it received: `input_weight` per prompt token it had computed
  (charged once, when its request is first admitted; prefix-cache hits are free) plus `output_weight` per
  token it was given, each divided by the tenant's weight (its tier's share weight, 1 by default).
- Among the waiting requests of one priority level, the next to run is the oldest request of the tenant
  with the smallest counter. Across levels the tier priority with ageing decides, as before (see
  loramux.engine.scheduler.rank_key): a level's claim is that of its longest-waiting request.
- Lifting on rejoin: a tenant with nothing waiting that sends a request has its counter raised to the
  smallest counter of the tenants still waiting in its level (or, with none waiting, to the counter of the
  last one whose queue emptied), so idle time is never banked as credit for a burst later.
- Preemption under KV pressure takes the lowest priority level first, then the tenant with the largest
  counter, then the latest arrival.

The bound (VTC's theorem 4.3, restated for continuous batching): while two tenants of one level stay
backlogged, the weighted service they receive over any interval differs by at most
`2 * U`, `U = input_weight * P + output_weight * N * G` (P the longest prompt, G the most new tokens of a
request, N the most sequences in a batch): an admission decision goes to the smaller counter, and what can
be in flight when it is made is one prompt plus a full batch of decodes. tests/test_fair_share.py checks it
at every step of a simulated run.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TenantShare:
    """One tenant's account: `counter` (virtual, lifted on rejoin) and `service` (weighted tokens actually
    received, never lifted: what Prometheus shows as a rate)."""

    counter: float = 0.0
    service: float = 0.0
    input_tokens: int = 0
    output_tokens: int = 0


class FairShare:
    """Virtual token counters per tenant. The scheduler tells it when a tenant's queue becomes non-empty
    (`joined`) or empty (`left`), and what each tenant was served (`charge_*`); it answers which tenant of
    a set goes first (`counter`)."""

    def __init__(self, input_weight: float = 1.0, output_weight: float = 2.0):
        if not (input_weight > 0 and output_weight > 0):
            raise ValueError("fair-share token weights must be > 0")
        self.input_weight = input_weight
        self.output_weight = output_weight
        self.tenants: dict[str, TenantShare] = {}
        self._last_left: dict[int, float] = {}  # level -> counter of the last tenant whose queue emptied

    def _account(self, tenant: str) -> TenantShare:
        share = self.tenants.get(tenant)
        if share is None:
            share = self.tenants[tenant] = TenantShare()
        return share

    def counter(self, tenant: str) -> float:
        share = self.tenants.get(tenant)
        return share.counter if share is not None else 0.0

    def joined(self, tenant: str, level: int, backlogged_counters: list[float]) -> None:
        """`tenant`'s queue in `level` went from empty to non-empty: lift its counter to the smallest of
        the tenants backlogged there (`backlogged_counters`), or to the last one to leave when none are."""
        floor = min(backlogged_counters) if backlogged_counters else self._last_left.get(level, 0.0)
        share = self._account(tenant)
        share.counter = max(share.counter, floor)

    def left(self, tenant: str, level: int) -> None:
        """`tenant`'s queue in `level` emptied (its requests all admitted or ended)."""
        self._last_left[level] = self.counter(tenant)

    def charge_input(self, tenant: str, tokens: int, weight: float = 1.0) -> None:
        """`tenant` (of tier weight `weight`) had `tokens` prompt tokens computed."""
        self._account(tenant).input_tokens += tokens
        self._charge(tenant, self.input_weight * tokens / weight)

    def charge_output(self, tenant: str, tokens: int, weight: float = 1.0) -> None:
        """`tenant` (of tier weight `weight`) was given `tokens` output tokens."""
        self._account(tenant).output_tokens += tokens
        self._charge(tenant, self.output_weight * tokens / weight)

    def _charge(self, tenant: str, amount: float) -> None:
        share = self._account(tenant)
        share.counter += amount
        share.service += amount

    def bound(self, longest_prompt: int, most_new_tokens: int, max_num_seqs: int) -> float:
        """The largest difference in weighted service between two backlogged tenants of one level (see the
        module docstring), for weight-1 tenants."""
        return 2 * (self.input_weight * longest_prompt + self.output_weight * max_num_seqs * most_new_tokens)

    def stats(self) -> dict[str, dict[str, float]]:
        """tenant -> {"counter", "service", "input_tokens", "output_tokens"}."""
        tenants = dict(self.tenants)  # one C-level copy: safe while the engine thread adds tenants
        return {tenant: {"counter": s.counter, "service": s.service, "input_tokens": s.input_tokens,
                         "output_tokens": s.output_tokens} for tenant, s in tenants.items()}
