"""An engine (on a cluster: a replica) lost under a running request, deterministically: the engine's stream
raises EngineDeadError right after the first generated token. A request that sent the client nothing is a
retriable 503 and unbilled (the client's retry is billed); a stream that already sent tokens ends with an
error event and is billed for them, with outcome "error"."""
from __future__ import annotations

import json

import pytest
from sqlalchemy import select

from conftest import live_stack, new_tenant_key
from loramux.db.models import LedgerEntry
from loramux.engine.async_engine import EngineDeadError


@pytest.fixture
def dying(tiny_dir, tokenizer, tmp_path):
    with live_stack(tmp_path, tiny_dir, tokenizer, client=True) as client:
        services = client.app.state.services
        real = services.engine.generate

        async def generate(*args, **kwargs):
            stream = real(*args, **kwargs)
            try:
                async for out in stream:
                    yield out
                    if out.new_token_ids:
                        raise EngineDeadError("the engine replica serving this request stopped; retry the request")
            finally:
                await stream.aclose()

        services.engine.generate = generate
        client.headers["Authorization"] = f"Bearer {new_tenant_key(services, 'lost-co', 'premium')}"
        yield client, services


def rows(services) -> list[LedgerEntry]:
    assert services.ledger.flush(30)
    with services.db.session() as session:
        return list(session.scalars(select(LedgerEntry)))


BODY = {"model": "base", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16, "temperature": 0,
        "ignore_eos": True}


def test_a_request_lost_before_anything_was_sent_is_a_retriable_503_and_unbilled(dying):
    client, services = dying
    answer = client.post("/v1/chat/completions", json=BODY)
    assert answer.status_code == 503 and answer.json()["error"]["code"] == "engine_stopped", answer.text
    assert int(answer.headers["Retry-After"]) >= 1
    assert rows(services) == []


def test_a_stream_lost_after_tokens_went_out_is_billed_for_them(dying):
    client, services = dying
    answer = client.post("/v1/chat/completions", json={**BODY, "stream": True})
    events = [line[6:] for line in answer.text.splitlines() if line.startswith("data: ")]
    assert "[DONE]" not in events and "error" in json.loads(events[-1])
    streamed = [json.loads(e) for e in events[:-1]]
    assert any(c["choices"] and c["choices"][0]["delta"].get("content") for c in streamed), events
    [row] = rows(services)
    assert row.request_id == streamed[0]["id"] and row.outcome == "error" and row.completion_tokens >= 1
