"""The price of a request that combined adapters: its costliest component's price (platform/billing/pricing.py
`price_for_composition`), applied by the ledger row (platform/billing/ledger_records.py `ledger_row`), set by admins
with ordinary adapter prices through the price API."""
from __future__ import annotations

from datetime import datetime, timedelta, timezone
from decimal import Decimal

from loramux.billing.ledger_records import ledger_row
from loramux.billing.pricing import PriceInfo, cost_of, price_for_composition
from loramux.billing.usage import RequestRecord

T0 = datetime(2026, 12, 1, tzinfo=timezone.utc)
BASE = "SmolLM2-135M-Instruct"


def _price(pid: int, adapter: str | None, tier: str | None, inp: str, out: str, at: datetime = T0) -> PriceInfo:
    return PriceInfo(pid, BASE, adapter, tier, Decimal(inp), Decimal(inp) / 2, Decimal(out), at)


PRICES = [
    _price(1, None, None, "1", "1"),
    _price(2, None, "premium", "0.5", "0.5"),
    _price(3, "ad_output_heavy", None, "1", "10"),
    _price(4, "ad_input_heavy", None, "5", "1"),
    _price(5, "ad_input_heavy", None, "50", "50", at=T0 + timedelta(days=30)),  # not yet in force
    _price(6, "ad_cheap", None, "0.1", "0.1"),
]


def _record(prompt: int, completion: int, adapters: list[str], tier: str = "standard") -> RequestRecord:
    return RequestRecord(
        request_id=f"r-{prompt}-{completion}-{'-'.join(adapters)}", tenant_id="t", key_id="key_x", tier=tier,
        model=BASE, adapter_id=None, adapter_version=None, adapter_digest=None, requested=BASE, fallback=False,
        outcome="stop", prompt_tokens=prompt, cached_tokens=0, completion_tokens=completion, queue_ms=1.0,
        ttft_ms=2.0, total_ms=3.0, created_at=T0 + timedelta(days=1),
        composition=[{"adapter_id": a, "version": 1, "digest": "d" * 64, "weight": 0.5} for a in adapters])


def test_the_costliest_components_price_applies():
    at = T0 + timedelta(days=1)
    both = ["ad_output_heavy", "ad_input_heavy"]
    # A long prompt, a short answer: the input-heavy adapter's price costs more.
    assert price_for_composition(PRICES, BASE, both, "standard", at, 1000, 0, 10).id == 4
    # A short prompt, a long answer: the output-heavy one's.
    assert price_for_composition(PRICES, BASE, both, "standard", at, 10, 0, 1000).id == 3
    # A tie (no tokens): the first component's price.
    assert price_for_composition(PRICES, BASE, both, "standard", at, 0, 0, 0).id == 3
    # Components without prices of their own: the base model's price for the tier, as for a base request.
    assert price_for_composition(PRICES, BASE, ["ad_plain"], "premium", at, 10, 0, 10).id == 2
    assert price_for_composition(PRICES, BASE, ["ad_plain", "ad_other"], "standard", at, 10, 0, 10).id == 1
    # A discounted adapter is billed at the (costlier) base price, alone or beside an unpriced one.
    assert price_for_composition(PRICES, BASE, ["ad_cheap"], "standard", at, 10, 0, 10).id == 1
    assert price_for_composition(PRICES, BASE, ["ad_cheap", "ad_plain"], "standard", at, 10, 0, 10).id == 1
    assert price_for_composition([], BASE, both, "standard", at, 10, 0, 10) is None


def test_a_composition_never_costs_less_than_the_base_model():
    """An adapter priced below the base (here $0) buys base-model output at no discount through a composition,
    whatever its weight: the base model's price for the tier is the floor."""
    at = T0 + timedelta(days=1)
    prices = [*PRICES, _price(7, "ad_free_demo", None, "0", "0")]
    assert price_for_composition(prices, BASE, ["ad_free_demo"], "standard", at, 10, 0, 10).id == 1
    assert price_for_composition(prices, BASE, ["ad_free_demo"], "premium", at, 10, 0, 10).id == 2
    assert price_for_composition(prices, BASE, ["ad_cheap", "ad_free_demo"], "standard", at, 10, 0, 10).id == 1
    # A costlier component still sets the price; the base applies only when strictly costlier (ties: component).
    assert price_for_composition(prices, BASE, ["ad_free_demo", "ad_output_heavy"], "standard", at, 10, 0,
                                 1000).id == 3
    assert price_for_composition([_price(8, "ad_same", None, "1", "1")], BASE, ["ad_same"], "standard", at, 10, 0,
                                 10).id == 8
    # In the ledger row: a weight-0 $0 component is billed at the base price, never $0.
    record = _record(1000, 10, ["ad_free_demo"])
    record.composition[0]["weight"] = 0
    row = ledger_row(record, prices)
    assert row["price_id"] == 1 and row["cost"] == cost_of(1000, 0, 10, PRICES[0]) > 0


def test_the_ledger_row_bills_a_composition_at_that_price():
    record = _record(1000, 10, ["ad_output_heavy", "ad_input_heavy"])
    row = ledger_row(record, PRICES)
    assert row["price_id"] == 4 and row["adapter_id"] is None and row["composition"] == record.composition
    assert row["cost"] == cost_of(1000, 0, 10, PRICES[3]) == Decimal("0.005010000000")
    plain = _record(1000, 10, ["ad_plain"])
    assert ledger_row(plain, PRICES)["price_id"] == 1
