"""The OpenAI surface beyond plain text, over real HTTP with the official `openai` client: JSON mode and
JSON schemas, tool calls, n > 1, top logprobs, logit_bias, echo, `user` in the ledger, the native API's
constraints, and a 400 that says what to fix for everything this server cannot do."""
from __future__ import annotations

import asyncio
import json
import random
import re
import uuid

import httpx
import jsonschema
import openai
import pytest
import torch
from sqlalchemy import select

from conftest import adapter_files, live_stack, new_tenant_key
from loramux.db.models import LedgerEntry
from loramux.model.loader import read_model_config
from loramux.testing import write_peft_adapter

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def stack(tiny_dir, tokenizer, tmp_path_factory):
    """One server for the module: a premium tenant (no rate limits) with one adapter, and a ledger hook."""
    tmp = tmp_path_factory.mktemp("openai-features")
    cfg, _ = read_model_config(tiny_dir)
    records = []
    with live_stack(tmp, tiny_dir, tokenizer,
                    engine=dict(max_loras=2, max_lora_rank=8, max_num_seqs=48, max_num_batched_tokens=1024),
                    ledger_hooks=[records.append]) as server:
        key = new_tenant_key(server.services, "acme", "premium")
        path = write_peft_adapter(tmp / "tuned", cfg, 8, ["q_proj", "v_proj", "down_proj"], seed=5, b_std=1.0)
        server.services.registry.register(server.services.tenancy.tenant("acme").id, "tuned", adapter_files(path))
        yield server, key, records


def client(stack) -> openai.OpenAI:
    server, key, _ = stack
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=300)


def aclient(stack) -> openai.AsyncOpenAI:
    server, key, _ = stack
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=300)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# -- JSON schemas: every string bounded (maxLength, pattern or enum), every array bounded, so a random
# model finishes; nested objects, arrays, enums, required, numeric ranges ---------------------------------
KEYS = ["id", "name", "kind", "score", "tags", "meta", "on", "size"]


def _value(rng: random.Random, depth: int) -> dict:
    kind = rng.choice(["string", "pattern", "integer", "number", "boolean", "enum", "array"]
                      + (["object"] if depth < 2 else []))
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 6)}
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice(["^[a-z]{1,4}$", "^[A-Z][0-9]{2}$", "^(on|off)$"])}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 200)}
    if kind == "number":
        return {"type": "number", "minimum": rng.randint(-5, 0), "maximum": rng.randint(1, 5)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", 7, None], rng.randint(1, 3))}
    if kind == "array":
        return {"type": "array", "items": _value(rng, depth + 1), "minItems": rng.randint(0, 1),
                "maxItems": 2}
    return _object(rng, depth + 1)


def _object(rng: random.Random, depth: int = 0) -> dict:
    names = rng.sample(KEYS, rng.randint(1, 3))
    required = names if rng.random() < 0.6 else rng.sample(names, rng.randint(0, len(names)))
    return {"type": "object", "properties": {n: _value(rng, depth) for n in names}, "required": required}


SCHEMAS = [_object(random.Random(1000 + i)) for i in range(52)]
PLAIN = ["The weather today is", "Tell me about cats.", "1, 2, 3, 4,", "Dear team, the meeting"]


def test_the_schemas_are_varied():
    text = json.dumps(SCHEMAS)
    for needle in ('"pattern"', '"enum"', '"minimum"', '"maxLength"', '"type": "array"', '"type": "number"'):
        assert needle in text, needle
    assert sum('"properties": {' in json.dumps(s)[1:] for s in SCHEMAS) > 10  # nested objects


def test_json_schemas_hold_greedy_and_sampled_with_and_without_an_adapter_beside_plain_requests(stack):
    """52 schemas at once (base / adapter x greedy / seeded sampling), alongside unconstrained requests whose
    greedy outputs must equal the same requests run alone: constraints never leak across rows."""
    async def constrained(i: int, schema: dict):
        out = await aclient(stack).chat.completions.create(
            model="tuned" if i % 2 else MODEL, messages=user(f"Describe item {i} as JSON."), max_tokens=300,
            temperature=0 if i % 4 < 2 else 1.0, seed=i,
            response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema,
                                                                    "strict": True}})
        return out.choices[0]

    async def plain(i: int):
        out = await aclient(stack).chat.completions.create(
            model="tuned" if i % 2 else MODEL, messages=user(PLAIN[i]), max_tokens=12, temperature=0,
            extra_body={"ignore_eos": True})
        return out.choices[0].message.content

    async def together():
        return await asyncio.gather(asyncio.gather(*(constrained(i, s) for i, s in enumerate(SCHEMAS))),
                                    asyncio.gather(*(plain(i) for i in range(len(PLAIN)))))

    choices, mixed = asyncio.run(together())
    for choice, schema in zip(choices, SCHEMAS):
        assert choice.finish_reason == "stop", (choice, schema)
        jsonschema.validate(json.loads(choice.message.content), schema)
    assert mixed == [asyncio.run(plain(i)) for i in range(len(PLAIN))]


def test_json_object_mode_streamed_and_not(stack, tokenizer):
    c = client(stack)
    # Nudges toward quotes and braces: a random model's free-form strings would otherwise run on for long.
    close = {str(tokenizer.encode(t)[0]): 6 for t in ('"', "}", '"}', '",')}
    kwargs = dict(model=MODEL, messages=user("Give me a JSON object."), max_tokens=400, logit_bias=close,
                  response_format={"type": "json_object"})
    for temperature in (0, 0.8):
        out = c.chat.completions.create(temperature=temperature, seed=3, **kwargs)
        assert out.choices[0].finish_reason == "stop"
        assert isinstance(json.loads(out.choices[0].message.content), dict)
        streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
            temperature=temperature, seed=3, stream=True, **kwargs) if ch.choices)
        assert streamed == out.choices[0].message.content
    text = c.completions.create(model=MODEL, prompt="JSON:", max_tokens=400, temperature=0, logit_bias=close,
                                extra_body={"response_format": {"type": "json_object"}}).choices[0].text
    assert isinstance(json.loads(text), dict)


# -- tool calls --------------------------------------------------------------------------------------
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                            "unit": {"enum": ["C", "F"]}},
           "required": ["city", "days"]}
CLOCK = {"type": "object", "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}}, "required": ["zone"]}
# strict: the client's stream helper parses the arguments of strict tools only
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                           "parameters": WEATHER, "strict": True}},
         {"type": "function", "function": {"name": "get_time", "description": "Current time", "parameters": CLOCK,
                                           "strict": True}}]
SCHEMA_OF = {"get_weather": WEATHER, "get_time": CLOCK}
ASK = user("What is the weather in Oslo for 3 days, and the time in CET?")


def assert_calls(message, names=None):
    assert not message.content and message.tool_calls, message
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert names is None or call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMA_OF[call.function.name])


@pytest.mark.parametrize("temperature", [0, 1.0])
def test_forced_tool_calls_follow_the_schema_streamed_and_not(stack, tokenizer, temperature):
    c = client(stack)
    # With parallel calls the answer is an array of 1 to 8 calls; a random model spells the JSON out in short
    # tokens, so 8 calls would not fit the tiny model's context: a nudge towards closing the array.
    close = {str(tokenizer.encode(t)[0]): 8 for t in ("]", "}]")}
    cases = [({"type": "function", "function": {"name": "get_time"}}, True, ["get_time"], 1, None),
             ("required", False, None, 1, None),
             ("required", True, None, None, close)]
    for choice, parallel, names, count, bias in cases:
        kwargs = dict(model="tuned", messages=ASK, tools=TOOLS, tool_choice=choice, parallel_tool_calls=parallel,
                      max_tokens=240, temperature=temperature, seed=11, logit_bias=bias)
        out = c.chat.completions.create(**kwargs)
        assert out.choices[0].finish_reason == "tool_calls", (out.usage, out.choices[0].message.content[-300:])
        assert_calls(out.choices[0].message, names)
        assert count is None or len(out.choices[0].message.tool_calls) == count
        with c.chat.completions.stream(**kwargs) as stream:  # the client's own accumulation of the deltas
            final = stream.get_final_completion()
        assert final.choices[0].finish_reason == "tool_calls"
        assert_calls(final.choices[0].message, names)
        assert [(t.function.name, t.function.arguments) for t in final.choices[0].message.tool_calls] == \
            [(t.function.name, t.function.arguments) for t in out.choices[0].message.tool_calls]


def test_a_conversation_with_tool_results_and_auto_choice(stack):
    c = client(stack)
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_abc", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}}]},
        {"role": "tool", "tool_call_id": "call_abc", "content": "12:00"}]
    out = c.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=8, temperature=0,
                                    extra_body={"ignore_eos": True})
    choice = out.choices[0]  # auto: the random model writes prose, which is content
    assert choice.finish_reason == "length" and choice.message.content and not choice.message.tool_calls
    without_tools = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                              extra_body={"ignore_eos": True})
    assert without_tools.usage.prompt_tokens < out.usage.prompt_tokens  # the tools are in the prompt
    streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, max_tokens=8, temperature=0, stream=True,
        extra_body={"ignore_eos": True}) if ch.choices)
    assert streamed == choice.message.content


# -- n, logprobs, logit_bias, echo, user ---------------------------------------------------------------
def test_n_choices_seeded_reproducible_distinct_and_billed_once(stack):
    _, _, records = stack
    c = client(stack)
    kwargs = dict(model=MODEL, messages=user(f"A long shared prompt {uuid.uuid4().hex} " + "with words " * 12),
                  n=4, max_tokens=8, temperature=1.0, seed=42, extra_body={"ignore_eos": True})
    before = len(records)
    first = c.chat.completions.create(**kwargs)
    assert len(records) == before + 1 and records[-1].request_id == first.id
    texts = [ch.message.content for ch in first.choices]
    assert [ch.index for ch in first.choices] == [0, 1, 2, 3] and len(set(texts)) == 4
    usage = first.usage
    assert usage.completion_tokens == 32 and records[-1].completion_tokens == 32
    assert records[-1].prompt_tokens == usage.prompt_tokens
    # Choice 0 computed the new prompt (only the chat template's fixed start was cached); its siblings found
    # all of its full blocks in the prefix cache. The prompt is billed once, with choice 0's cached tokens.
    cached = usage.prompt_tokens_details.cached_tokens
    shared = first.model_extra["loramux"]["choice_cached_tokens"]
    assert shared[0] == cached == records[-1].cached_tokens < 32, shared
    assert all(s == usage.prompt_tokens // 16 * 16 for s in shared[1:]), (shared, usage.prompt_tokens)
    again = c.chat.completions.create(**kwargs)
    assert [ch.message.content for ch in again.choices] == texts
    assert again.usage.prompt_tokens_details.cached_tokens == shared[1]  # the prompt is in the cache now
    streamed = ["", "", "", ""]
    chunks = list(c.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    for chunk in chunks:
        for ch in chunk.choices:
            streamed[ch.index] += ch.delta.content or ""
    assert streamed == texts and chunks[-1].usage.completion_tokens == 32
    assert sorted(ch.choices[0].index for ch in chunks if ch.choices and ch.choices[0].finish_reason) == [0, 1, 2, 3]
    kwargs = dict(model=MODEL, prompt="Once upon a time", n=3, max_tokens=5, temperature=1, seed=9,
                  extra_body={"ignore_eos": True})
    completions = c.completions.create(**kwargs)
    assert len({ch.text for ch in completions.choices}) == 3 and completions.usage.completion_tokens == 15
    texts = ["", "", ""]
    chunks = list(c.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    for chunk in chunks:
        for ch in chunk.choices:
            texts[ch.index] += ch.text
    assert texts == [ch.text for ch in completions.choices]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 15


@pytest.fixture(scope="module")
def hf_model(tiny_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()


def greedy_log_softmax(model, ids: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """The greedy continuation of `ids` by the HF model, and the log-softmax at each generated position."""
    ids, dists = list(ids), []
    with torch.no_grad():
        for _ in range(steps):
            dist = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].double(), -1)
            dists.append(dist)
            ids.append(int(dist.argmax()))
    return ids[len(ids) - steps:], dists


def test_top_logprobs_are_the_models_log_softmax(stack, tokenizer, hf_model):
    c = client(stack)
    messages = user("Name three colours.")
    out = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0, logprobs=True,
                                    top_logprobs=5, extra_body={"ignore_eos": True})
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
    ids, dists = greedy_log_softmax(hf_model, prompt, 6)
    entries = out.choices[0].logprobs.content
    assert [e.token for e in entries] == [tokenizer.decode([i]) for i in ids]
    for entry, dist in zip(entries, dists):
        values, top_ids = dist.topk(5)
        assert [t.token for t in entry.top_logprobs] == [tokenizer.decode([int(i)]) for i in top_ids]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(values.tolist(), abs=1e-4)
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-6)  # greedy: the top one
    streamed = [e for ch in c.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=5, stream=True,
        extra_body={"ignore_eos": True}) if ch.choices and ch.choices[0].logprobs
        for e in ch.choices[0].logprobs.content]
    assert [(e.token, len(e.top_logprobs)) for e in streamed] == [(e.token, 5) for e in entries]
    # Up to 20 on completions too (OpenAI stops at 5); tokens that decode to the same text share a key.
    legacy = c.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logprobs=20,
                                  extra_body={"ignore_eos": True}).choices[0].logprobs
    for token, logprob, top, dist in zip(legacy.tokens, legacy.token_logprobs, legacy.top_logprobs, dists):
        assert top[token] == pytest.approx(logprob, abs=1e-6) and 10 <= len(top) <= 20
        assert sorted(top.values(), reverse=True) == pytest.approx(dist.topk(len(top)).values.tolist(), abs=1e-4)


def test_logit_bias_bans_and_forces_tokens(stack, tokenizer, hf_model):
    c = client(stack)
    prompt = tokenizer.encode("Once upon a time")
    ids, _ = greedy_log_softmax(hf_model, prompt, 4)
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, logprobs=0, extra_body={"ignore_eos": True})
    plain = c.completions.create(**kwargs).choices[0].logprobs.tokens
    assert plain == [tokenizer.decode([i]) for i in ids]
    banned = c.completions.create(logit_bias={str(i): -100 for i in set(ids)}, **kwargs).choices[0].logprobs.tokens
    assert not set(banned) & set(plain)
    cat = tokenizer.encode(" cat")[0]
    for temperature in (0, 1.0):
        forced = c.completions.create(**{**kwargs, "temperature": temperature}, logit_bias={str(cat): 100})
        assert forced.choices[0].text == " cat" * 4


def test_echo_prepends_the_prompt_with_null_logprobs(stack, tokenizer):
    c = client(stack)
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    plain = c.completions.create(**kwargs).choices[0].text
    echoed = c.completions.create(echo=True, logprobs=2, **kwargs).choices[0]
    assert echoed.text == "Once upon a time" + plain
    n = len(tokenizer.encode("Once upon a time"))
    lp = echoed.logprobs
    assert "".join(lp.tokens) == echoed.text and len(lp.tokens) == n + 4
    assert lp.token_logprobs[:n] == [None] * n and lp.top_logprobs[:n] == [None] * n
    assert all(v <= 0 for v in lp.token_logprobs[n:]) and all(1 <= len(t) <= 2 for t in lp.top_logprobs[n:])
    assert lp.text_offset[n] == len("Once upon a time") and lp.text_offset == sorted(lp.text_offset)
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(echo=True, stream=True, **kwargs)
                       if ch.choices)
    assert streamed == echoed.text
    ids = c.completions.create(echo=True, **{**kwargs, "prompt": tokenizer.encode("Hello there")}).choices[0].text
    assert ids.startswith("Hello there")


def test_user_is_recorded_in_the_ledger_row(stack):
    server, _, records = stack
    out = client(stack).chat.completions.create(model=MODEL, messages=user("hi"), max_tokens=2, user="end-user-42")
    assert next(r for r in records if r.request_id == out.id).end_user == "end-user-42"
    services = server.services
    services.ledger.flush(30)
    with services.db.session() as session:
        stored = session.scalar(select(LedgerEntry.end_user).where(LedgerEntry.request_id == out.id))
    assert stored == "end-user-42"


# -- the native API --------------------------------------------------------------------------------------
def test_native_constraints(stack):
    server, key, _ = stack
    headers = {"Authorization": f"Bearer {key}"}

    def generate(**body):
        return httpx.post(f"{server.url}/generate", json={"max_tokens": 64, **body}, headers=headers, timeout=120)

    regex = r"[a-c]{2,4}-[0-9]{2}"
    for temperature in (0, 1.0):
        out = generate(prompt="Code:", regex=regex, temperature=temperature, seed=1).json()
        assert out["finish_reason"] == "stop" and re.fullmatch(regex, out["text"]), out
        out = generate(messages=user("yes or no?"), choice=["yes", "no", "not sure"], temperature=temperature).json()
        assert out["text"] in ("yes", "no", "not sure")
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]}
    out = generate(prompt="JSON:", response_format={"type": "json_schema", "json_schema": {"name": "x",
                                                                                         "schema": schema}}).json()
    jsonschema.validate(json.loads(out["text"]), schema)
    two = generate(prompt="x", regex="a+", choice=["a"])
    assert two.status_code == 400 and "at most one output constraint, not regex and choice" in two.text
    assert generate(prompt="x", choice=[]).status_code == 400
    bad = generate(prompt="x", regex="(unclosed")
    assert bad.status_code == 400 and "regex" in bad.json()["error"]["message"]


# -- every refusal is a 400 that says what to fix ----------------------------------------------------------
def bad_request(call, *needles: str) -> str:
    with pytest.raises(openai.BadRequestError) as info:
        call()
    message = info.value.body["message"] if isinstance(info.value.body, dict) else str(info.value)
    for needle in needles:
        assert needle in message, message
    return message


def test_refusals_say_what_to_fix(stack):
    server, _, _ = stack
    c = client(stack)
    chat = c.chat.completions.create
    base = dict(model=MODEL, messages=user("hi"), max_tokens=4)

    def schema(s):
        return {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}

    bad_request(lambda: chat(**base, response_format=schema({"type": "object", "properties": {"a": {"type": "nope"}}})),
                "json_schema")
    bad_request(lambda: chat(**base, response_format=schema({"not": {"type": "string"}})), "not")
    bad_request(lambda: chat(**base, response_format={"type": "yaml"}), "'yaml'", "text, json_object, json_schema")
    bad_request(lambda: chat(**base, response_format={"type": "json_schema"}), '"json_schema" object')
    bad_request(lambda: chat(**base, n=17), "tier 'premium' allows at most 16 choices")
    bad_request(lambda: chat(**base, logit_bias={"abc": 1}), "'abc' is not a token id")
    bad_request(lambda: chat(**base, logit_bias={"999999999": 1}), "999999999")
    bad_request(lambda: chat(**base, logit_bias={"5": 101}), "logit_bias")
    bad_request(lambda: chat(**base, top_logprobs=3), "top_logprobs needs logprobs: true")
    bad_request(lambda: chat(**base, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "fly"}}),
                "'fly'", "get_time, get_weather")
    bad_request(lambda: chat(**base, tools=[{"type": "function", "function": {"description": "no name"}}]),
                "tools.0.function.name")
    bad_request(lambda: chat(**base, tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "nope"}}}}}]), "tools' parameters schema")
    bad_request(lambda: chat(**base, tool_choice="required"), "no tools")
    bad_request(lambda: chat(**base, tools=TOOLS, response_format={"type": "json_object"}), "cannot be combined")
    bad_request(lambda: chat(**base, functions=[{"name": "f"}]), "`functions`", "use `tools`")
    bad_request(lambda: chat(**base, function_call="auto"), "use `tool_choice`")
    bad_request(lambda: chat(**base, modalities=["text", "audio"]), "text only")
    bad_request(lambda: chat(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]), "images are not served", "'image_url'",
        "as text")
    complete = c.completions.create
    bad_request(lambda: complete(model=MODEL, prompt="hi", suffix="end"), "suffix")
    bad_request(lambda: complete(model=MODEL, prompt="hi", best_of=3), "best_of", "ask for `n` choices")
    bad_request(lambda: complete(model=MODEL, prompt=["a", "b"]), "one prompt per request")
    bad_request(lambda: complete(model=MODEL, prompt="hi", n=20), "tier 'premium' allows at most 16 choices")
    resp = httpx.post(f"{server.url}/v1/chat/completions", headers={"Authorization": f"Bearer {stack[1]}"},
                      json={**base, "user": "u" * 257})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "user", resp.text
    stats = server.services.engine.stats()
    assert stats["running"] == 0 and stats["waiting"] == 0
