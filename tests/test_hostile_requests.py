"""Request shapes a hostile (or careless) tenant sends, against the real ASGI app: each is refused with a
clear 4xx before it costs anything, or served and billed exactly once. Never free inference, never a
limit dodged, never an answered request without its ledger row."""
from __future__ import annotations

import json
import string

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import select

from conftest import make_engine, make_services, new_tenant_key
from loramux.db.models import LedgerEntry
from loramux.server.app import create_app
from loramux.tenancy import TierInfo

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture
def stack(tiny_dir, tokenizer, tmp_path, database_url):
    """The app over the tiny model on SQLite and on PostgreSQL; a premium tenant (no rate limits)."""
    app = create_app(lambda: make_services(tmp_path, make_engine(tiny_dir, tokenizer), database_url=database_url))
    with TestClient(app) as client:
        services = app.state.services
        key = new_tenant_key(services, f"hostile-{tmp_path.name[-12:]}", "premium")
        client.headers["Authorization"] = f"Bearer {key}"
        yield client, services


def ledger_ids(services) -> set[str]:
    assert services.ledger.flush(30)
    with services.db.session() as session:
        return set(session.scalars(select(LedgerEntry.request_id)))


def rejected_lines(services) -> list[str]:
    path = services.ledger.rejected_path
    return path.read_text().splitlines() if path.exists() else []


def chat(client, **extra):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}
    return client.post("/v1/chat/completions", json=body)


@pytest.mark.parametrize("user", ["", "\u0000", "a\u0000b", "tab\there", "\u0085", "\x7f"])
def test_odd_user_values_are_either_no_user_or_a_400_naming_it_and_never_free(stack, user):
    client, services = stack
    answer = chat(client, user=user)
    if user == "":
        assert answer.status_code == 200, answer.text
        rows = {r.request_id: r for r in _rows(services)}
        assert rows[answer.json()["id"]].end_user is None  # empty means no user
    else:
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["param"] == "user" and "control characters" in error["message"]
    assert rejected_lines(services) == []


def _rows(services) -> list[LedgerEntry]:
    assert services.ledger.flush(30)
    with services.db.session() as session:
        return list(session.scalars(select(LedgerEntry)))


@pytest.mark.parametrize("stream", [False, True])
def test_a_record_the_ledger_refuses_fails_the_request_instead_of_answering_200(stack, monkeypatch, stream):
    """Whatever slips past intake and is refused by the ledger's checks makes the answer a 500 (an error
    event on a stream, with no [DONE]), logged and counted; nothing is answered unbilled."""
    import loramux.admin.ledger as ledger_module
    from loramux.admin.ledger_records import LedgerRecordError

    client, services = stack

    def refuse(record):
        raise LedgerRecordError("refused for the test")

    monkeypatch.setattr(ledger_module, "check_record", refuse)
    answer = chat(client, stream=stream)
    if stream:
        assert answer.status_code == 200  # the headers went out before the end
        events = [line[6:] for line in answer.text.splitlines() if line.startswith("data: ")]
        assert "[DONE]" not in events
        error = json.loads(events[-1])["error"]
    else:
        assert answer.status_code == 500, answer.text
        error = answer.json()["error"]
    assert error["code"] == "billing_failed" and "not charged" in error["message"]
    metrics = client.get("/metrics").text
    assert "loramux_unbilled_requests_total 1.0" in metrics


def test_n_choices_are_charged_n_times_max_tokens_and_hold_n_concurrency_slots(stack):
    client, services = stack
    tight = TierInfo(name="tight", priority=0, requests_per_min=0, tokens_per_min=400, max_concurrent=3,
                     default_timeout_s=60, max_timeout_s=60, max_choices=4)
    services.tenancy.upsert_tier(tight)
    key = new_tenant_key(services, "tight-co", "tight")
    headers = {"Authorization": f"Bearer {key}"}
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 150, "temperature": 0}
    assert client.post("/v1/completions", json=body, headers=headers).status_code == 200
    # 3 x 150 tokens can never fit 400 tokens a minute: a 400 naming the limit, not a free pass.
    refused = client.post("/v1/completions", json={**body, "n": 3}, headers=headers)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "request_too_large", refused.text
    limiter = client.app.state.server.limiter
    tenant_id = services.tenancy.tenant("tight-co").id
    assert limiter.in_flight(tenant_id) == 0
    # Concurrency counts sequences: a request of n=3 takes all 3 slots of the tier while it runs.
    held = limiter.admit(tenant_id, "tight", _limits(tight), 1, slots=1)
    try:
        busy = client.post("/v1/completions", json={**body, "n": 3, "max_tokens": 2}, headers=headers)
        assert busy.status_code == 429 and "requests in flight" in busy.json()["error"]["message"], busy.text
    finally:
        held.release(0)
    ok = client.post("/v1/completions", json={**body, "n": 3, "max_tokens": 2}, headers=headers)
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 3
    assert limiter.in_flight(tenant_id) == 0


def _limits(tier: TierInfo):
    from loramux.server.ratelimit import TierLimits

    return TierLimits(tier.requests_per_min, tier.tokens_per_min, tier.max_concurrent)


# Field values a fuzzer (or an attacker) tries: odd users, several choices, constraints, tools.
_ODD_TEXT = st.text(alphabet=st.characters(codec="utf-8"), max_size=12) | st.sampled_from(
    ["", " ", "\u0000", "\u202e", "😀", "a" * 256, "a" * 257, "\\", '"', "\ud7ff"])
_TOOL = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}


@st.composite
def odd_requests(draw):
    body = {"model": MODEL, "messages": [{"role": "user", "content": draw(_ODD_TEXT) or "hi"}],
            "max_tokens": draw(st.integers(1, 3)), "temperature": draw(st.sampled_from([0, 1]))}
    if draw(st.booleans()):
        body["user"] = draw(_ODD_TEXT)
    if draw(st.booleans()):
        body["n"] = draw(st.integers(1, 3))
    kind = draw(st.sampled_from(["plain", "json", "tools", "stream"]))
    if kind == "json":
        body["response_format"] = {"type": "json_object"}
    elif kind == "tools":
        body["tools"] = [_TOOL]
        body["tool_choice"] = draw(st.sampled_from(["auto", "required", "none"]))
    elif kind == "stream":
        body["stream"] = True
    return body


def test_every_answered_request_has_exactly_one_ledger_row_whatever_its_fields(stack):
    """A few hundred generated requests with odd field values: the answered ones (200) and the ledger's
    rows are the same set of request ids, nothing is refused by the ledger, and no request is a 5xx."""
    client, services = stack
    before = ledger_ids(services)
    answered, statuses = [], []

    @settings(max_examples=200, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(odd_requests())
    def send(body):
        response = client.post("/v1/chat/completions", json=body)
        statuses.append(response.status_code)
        assert response.status_code < 500, (body, response.text)
        if response.status_code != 200:
            return
        if body.get("stream"):
            events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]", (body, events[-2:])
            answered.append(json.loads(events[0])["id"])
        else:
            answered.append(response.json()["id"])

    send()
    assert len(statuses) == 200 and statuses.count(200) >= 100, statuses
    assert ledger_ids(services) - before == set(answered)
    assert len(answered) == len(set(answered))
    assert rejected_lines(services) == []


@pytest.mark.parametrize("printable", [string.ascii_letters])
def test_a_long_user_is_a_400_naming_it(stack, printable):
    client, _ = stack
    answer = chat(client, user=printable * 10)
    assert answer.status_code in (400, 422) and answer.json()["error"]["param"] == "user", answer.text
