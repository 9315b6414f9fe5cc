"""Structured output in the engine (xgrammar): JSON schemas, json_object, regex and choice constraints hold
for greedy and sampled decoding, in batches mixed with unconstrained rows and adapters, with speculation
on and off; compile errors surface as StructuredOutputError / RequestError; top_logprobs and logit_bias."""
from __future__ import annotations

import json
import random
import re
import threading

import jsonschema
import pytest
import torch

from conftest import make_engine, run_to_completion
from loramux.adapters.formats.peft import load_adapter_dir
from loramux.engine.async_engine import AsyncEngine
from loramux.engine.engine import RequestError
from loramux.engine.sampling.params import SamplingParams, StructuredOutput
from loramux.engine.sampling.sampler import Sampler
from loramux.engine.structured.constraint import Constraint
from loramux.engine.structured.grammar import (
    MAX_SPEC_BYTES,
    GrammarCache,
    StructuredOutputError,
    allocate_mask,
    apply_mask_,
    pack_mask,
)
from loramux.testing import write_peft_adapter

# Every string is bounded (maxLength, pattern or enum): a random model would otherwise rarely close one.
HANDWRITTEN = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}, "required": ["name"]},
    {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["age"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"x": {"type": "number", "minimum": -5, "maximum": 5}}, "required": ["x"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"v": {"enum": [1, "two", None, True]}}, "required": ["v"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 4},
                                               "minItems": 1, "maxItems": 3}}, "required": ["tags"]},
    {"type": "object", "properties": {"pts": {"type": "array", "minItems": 2, "maxItems": 2,
                                              "items": {"type": "integer", "minimum": 0, "maximum": 9}}},
     "required": ["pts"]},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"}},
     "required": ["code"]},
    {"type": "object", "properties": {"word": {"type": "string", "minLength": 3, "maxLength": 5}},
     "required": ["word"]},
    {"type": "object", "properties": {"maybe": {"type": ["string", "null"], "maxLength": 4}}, "required": ["maybe"]},
    {"type": "object", "properties": {"n": {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 3},
                                                      {"type": "null"}]}}, "required": ["n"]},
    {"type": "object", "properties": {"inner": {"type": "object", "required": ["a", "b"], "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"type": "boolean"}}}}, "required": ["inner"]},
    {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 1000},
                                      "note": {"type": "string", "maxLength": 6}}, "required": ["id"]},
    {"type": "object", "properties": {"k": {"const": "fixed"}, "m": {"type": "integer", "minimum": 0, "maximum": 5}},
     "required": ["k", "m"]},
    {"type": "object", "required": ["items"], "properties": {"items": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"q": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["q"]}}}},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 4},
    {"type": "string", "maxLength": 10},
    {"type": "integer", "minimum": -50, "maximum": 50},
    {"enum": ["alpha", "beta"]},
    {"type": "object", "properties": {"ratio": {"type": "number", "minimum": 0, "maximum": 1},
                                      "flag": {"type": ["boolean", "null"]}}, "required": ["ratio", "flag"]},
    {"type": "object", "$defs": {"pt": {"type": "object", "required": ["x", "y"], "properties": {
        "x": {"type": "integer", "minimum": 0, "maximum": 9}, "y": {"type": "integer", "minimum": 0, "maximum": 9}}}},
     "properties": {"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}}, "required": ["a", "b"]},
    {"type": "object", "properties": {"s": {"anyOf": [{"type": "string", "maxLength": 3},
                                                      {"type": "integer", "minimum": 0, "maximum": 9}]}},
     "required": ["s"]},
    {"type": "object", "properties": {"e": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}},
     "required": ["e"]},
    {"type": "object", "required": ["mx"], "properties": {"mx": {"type": "array", "maxItems": 2, "items": {
        "type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 2}}}},
]
NAMES = ["id", "name", "kind", "score", "tags", "meta", "on", "x"]


def _random_value_schema(rng: random.Random, depth: int) -> dict:
    kind = rng.choice(["string", "integer", "number", "boolean", "enum", "nullable"]
                      + (["object", "array"] if depth < 3 else []))
    if kind == "string":
        if rng.random() < 0.3:
            return {"type": "string", "pattern": rng.choice(["^[a-z]{1,4}$", "^[0-9]{2,3}$", "^(yes|no)$"])}
        low = rng.randint(0, 3)
        return {"type": "string", "minLength": low, "maxLength": low + rng.randint(0, 5)}
    if kind == "integer":
        low = rng.randint(-100, 100)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 500)}
    if kind == "number":
        return {"type": "number", "minimum": rng.randint(-10, 0), "maximum": rng.randint(1, 10)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["a", "bb", "ccc", 1, 2.5, None, False], rng.randint(1, 4))}
    if kind == "nullable":
        return {"type": ["integer", "null"], "minimum": 0, "maximum": 9}
    if kind == "array":
        low = rng.randint(0, 2)
        return {"type": "array", "items": _random_value_schema(rng, depth + 1), "minItems": low,
                "maxItems": low + rng.randint(0, 2)}
    return _random_object_schema(rng, depth + 1)


def _random_object_schema(rng: random.Random, depth: int = 0) -> dict:
    names = rng.sample(NAMES, rng.randint(1, 4))
    required = names if rng.random() < 0.7 else rng.sample(names, rng.randint(0, len(names)))
    return {"type": "object", "properties": {n: _random_value_schema(rng, depth + 1) for n in names},
            "required": required}


SCHEMAS = HANDWRITTEN + [_random_object_schema(random.Random(i)) for i in range(30)]


def schema_spec(schema: dict) -> StructuredOutput:
    return StructuredOutput("json_schema", json.dumps(schema, sort_keys=True, separators=(",", ":")))


def assert_valid(out, schema: dict) -> None:
    assert out.finish_reason == "stop", (out.finish_reason, out.text, schema)
    jsonschema.validate(json.loads(out.text), schema)


PLAIN_PROMPTS = ["The weather today is", "def add(a, b):", "1, 2, 3, 4,", "Dear team, the meeting"]


@pytest.fixture(scope="module")
def engine(tiny_dir, tokenizer):
    return make_engine(tiny_dir, tokenizer, max_num_seqs=64, max_num_batched_tokens=1024)


def test_the_schemas_are_varied_and_all_compile(engine):
    assert len(SCHEMAS) >= 50 and len({json.dumps(s, sort_keys=True) for s in SCHEMAS}) == len(SCHEMAS)
    text = json.dumps(SCHEMAS)
    for keyword in ("minItems", "maxItems", "enum", "required", "minimum", "maximum", "pattern", "minLength",
                    "maxLength", "boolean", '"null"', "$ref", "anyOf", "const"):
        assert keyword in text, keyword
    for schema in SCHEMAS:
        engine.compile_structured(schema_spec(schema))


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_every_schema_holds_in_a_batch_mixed_with_unconstrained_rows(engine, sampled):
    """All schemas and a few unconstrained requests in one continuous batch: every constrained output
    parses and validates, and the unconstrained rows produce exactly what they produce alone."""
    knobs = dict(temperature=0.9, top_p=0.95) if sampled else {}
    constrained = [(f"Reply in JSON #{i}:", SamplingParams(max_tokens=384, structured=schema_spec(s),
                                                           seed=i if sampled else None, **knobs), None)
                   for i, s in enumerate(SCHEMAS)]
    plain = [(p, SamplingParams(max_tokens=24, ignore_eos=True, seed=7 if sampled else None, **knobs), None)
             for p in PLAIN_PROMPTS]
    outs = run_to_completion(engine, constrained + plain)
    for out, schema in zip(outs, SCHEMAS):
        assert_valid(out, schema)
    alone = [run_to_completion(engine, [r])[0].token_ids for r in plain]
    assert [o.token_ids for o in outs[len(constrained):]] == alone
    assert len({o.text for o in outs[:len(constrained)]}) > len(SCHEMAS) // 2  # not one degenerate output
    if sampled:  # a seeded constrained request is the same whatever shares its batch
        for i in (0, 12, 21, 40):
            assert run_to_completion(engine, [constrained[i]])[0].token_ids == outs[i].token_ids
    assert engine.block_manager.num_used_blocks == 0


def test_constrained_requests_with_adapters(tiny_dir, tokenizer, tiny_cfg, tmp_path):
    adapters = [load_adapter_dir(write_peft_adapter(tmp_path / f"a{i}", tiny_cfg, 4, ["q_proj", "v_proj", "down_proj"],
                                                    seed=i, b_std=0.3), tiny_cfg, name=f"a{i}") for i in range(2)]
    engine = make_engine(tiny_dir, tokenizer, max_loras=2, max_lora_rank=8, max_num_seqs=64)
    schemas = SCHEMAS[::2]
    requests = [(f"JSON please {i}", SamplingParams(max_tokens=384, structured=schema_spec(s),
                                                    temperature=0.8 * (i % 2), seed=i), [None, *adapters][i % 3])
                for i, s in enumerate(schemas)]
    requests.append(("Plain text", SamplingParams(max_tokens=20, ignore_eos=True), adapters[0]))
    outs = run_to_completion(engine, requests)
    for out, schema in zip(outs, schemas):
        assert_valid(out, schema)
    assert outs[1].adapter == "a0" and outs[2].adapter == "a1"
    for i in (1, 2, 4, len(requests) - 1):  # an adapter's constrained rows: the same alone as in the batch
        assert run_to_completion(engine, [requests[i]])[0].token_ids == outs[i].token_ids
    # The adapter changes what the grammar lets through (the same request on the base model differs).
    base = [run_to_completion(engine, [(p, sp, None)])[0].token_ids for p, sp, a in requests[1:12] if a is not None]
    assert base != [o.token_ids for o, r in zip(outs[1:12], requests[1:12]) if r[2] is not None]


def test_speculation_gives_the_same_constrained_outputs(tiny_dir, tokenizer):
    """Prompt-lookup drafts of constrained rows are cut to what the grammar allows and verified under the
    grammar's mask at every position: greedy outputs are identical with speculation on and off."""
    schemas = SCHEMAS[:14]
    # JSON in the prompt gives the n-gram lookup something to draft from.
    requests = [(f"Example: {json.dumps({'a': {'x': 3, 'y': 3}, 'name': 'ab', 'tags': ['a', 'a']})} Now:",
                 SamplingParams(max_tokens=256, structured=schema_spec(s)), None) for s in schemas]
    requests += [(p, SamplingParams(max_tokens=30, ignore_eos=True), None) for p in PLAIN_PROMPTS[:2]]
    requests += [("x " * 20, SamplingParams(max_tokens=100, structured=StructuredOutput("regex", "(x ){3,40}")), None)]
    outputs = {}
    for k in (0, 4):
        engine = make_engine(tiny_dir, tokenizer, speculative_tokens=k, speculative_max_batch=32)
        outputs[k] = [o.token_ids for o in run_to_completion(engine, requests)]
        if k:
            stats = engine.stats()
            assert stats["spec_proposed_tokens"] > 20 and stats["spec_accepted_tokens"] > 5, stats
            # Sampled (unseeded) rows speculate too: rejection sampling under the masks keeps them valid.
            sampled = [(p, SamplingParams(max_tokens=256, structured=sp.structured, temperature=0.8), None)
                       for p, sp, _ in requests[:len(schemas)]]
            for out, schema in zip(run_to_completion(engine, sampled), schemas):
                assert_valid(out, schema)
            assert engine.stats()["spec_proposed_tokens"] > stats["spec_proposed_tokens"]
    assert outputs[4] == outputs[0]


def test_a_draft_is_cut_at_the_first_token_the_grammar_rejects(engine, tokenizer):
    constraint = Constraint(engine.grammars, StructuredOutput("choice", json.dumps(["yes please", "no"])))
    good = tokenizer.encode("yes please")
    draft = good + tokenizer.encode(" more")
    assert constraint.cut_draft(draft) == good  # the grammar is complete after "yes please": the cut
    assert constraint.cut_draft([good[0], *tokenizer.encode("}")]) == [good[0]]
    assert constraint.accept(good[0])  # rolling back after each walk left the matcher at the start
    rejected = tokenizer.encode("}")[0]
    assert not constraint.accept(rejected) and not constraint.done


def test_regex_choice_and_json_object(engine, tokenizer):
    regexes = [r"[a-z]{3,6}-[0-9]{2}", r"(yes|no|maybe)", r"\d{4}-\d{2}-\d{2}",
               r"[A-Z][a-z]{1,5}( [A-Z][a-z]{1,5}){0,2}", r"0x[0-9a-f]{2,8}", r"\(\d\)\+\[\.\]\*"]
    choices = [["red", "green", "blue"], ['say "hi"', "back\\slash", "new\nline", "ünïcode", "a|b"], ["a", "ab", "abc"]]
    # Nudges toward closing braces and quotes: free-form strings of a random model would run on for long.
    close = {tokenizer.encode(t)[0]: 6.0 for t in ('"', '}', '"}', '",')}
    requests = [(f"r{i}", SamplingParams(max_tokens=64, structured=StructuredOutput("regex", rx),
                                         temperature=0.7 * (i % 2), seed=i), None) for i, rx in enumerate(regexes)]
    requests += [(f"c{i}", SamplingParams(max_tokens=64, structured=StructuredOutput("choice", json.dumps(c)),
                                          temperature=1.0, seed=i), None) for i, c in enumerate(choices)]
    requests += [(f"o{i}", SamplingParams(max_tokens=512, structured=StructuredOutput("json_object"), logit_bias=close,
                                          temperature=0.5 * i, seed=i), None) for i in range(3)]
    outs = run_to_completion(engine, requests)
    for out, rx in zip(outs, regexes):
        assert out.finish_reason == "stop" and re.fullmatch(rx, out.text), (rx, out.text)
    for out, c in zip(outs[len(regexes):], choices):
        assert out.finish_reason == "stop" and out.text in c, (c, out.text)
    for out in outs[len(regexes) + len(choices):]:
        assert out.finish_reason == "stop" and isinstance(json.loads(out.text), dict), out.text


def test_the_grammar_decides_when_to_stop(engine, tokenizer):
    """A complete grammar ends the request at once ("stop", no EOS generated); min_tokens and ignore_eos do
    not hold it back; an unfinished grammar is cut by max_tokens ("length")."""
    yes = StructuredOutput("choice", json.dumps(["yes"]))
    for params in (SamplingParams(max_tokens=50, structured=yes),
                   SamplingParams(max_tokens=50, min_tokens=20, structured=yes),
                   SamplingParams(max_tokens=50, ignore_eos=True, structured=yes)):
        out = run_to_completion(engine, [("Answer:", params, None)])[0]
        assert (out.text, out.finish_reason) == ("yes", "stop")
        assert tokenizer.decode(out.token_ids) == "yes" and not set(out.token_ids) & engine.eos_token_ids
    # Complete but able to go on ("a" or "aa"...): the model may stop there, and only a stop token ends it.
    out = run_to_completion(engine, [("a", SamplingParams(max_tokens=30, structured=StructuredOutput("regex", "a+")),
                                      None)])[0]
    assert re.fullmatch("a+", out.text) and out.finish_reason in ("stop", "length")
    if out.finish_reason == "stop":
        assert out.token_ids[-1] in engine.eos_token_ids
    long = StructuredOutput("json_schema", json.dumps({"type": "string", "minLength": 200}))
    out = run_to_completion(engine, [("x", SamplingParams(max_tokens=8, structured=long), None)])[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 8 and out.text.startswith('"')


BAD_SPECS = [
    (StructuredOutput("json_schema", "{not json"), "not valid JSON"),
    (StructuredOutput("json_schema", "[1, 2]"), "must be a JSON object"),
    (StructuredOutput("json_schema", json.dumps({"type": "object", "patternProperties": {"^a": {}}})),
     "unsupported keyword 'patternProperties'"),
    (StructuredOutput("json_schema", json.dumps({"type": "object", "properties": {"a": {"not": {"type": "string"}}}})),
     "unsupported keyword 'not'"),
    (StructuredOutput("json_schema", json.dumps({"type": "array", "uniqueItems": True})), "'uniqueItems'"),
    (StructuredOutput("json_schema", json.dumps({"type": "frobnicate"})), 'Unsupported type "frobnicate"'),
    (StructuredOutput("json_schema", json.dumps({"$ref": "#/$defs/missing"})), "missing"),
    (StructuredOutput("json_schema", json.dumps({"type": "string", "pattern": "a(("})), "parenthesis"),
    (StructuredOutput("json_schema", json.dumps({"type": "object", "description": "x" * MAX_SPEC_BYTES})), "bytes"),
    (StructuredOutput("regex", "a(b"), "parenthesis is not closed"),
    (StructuredOutput("regex", "a(?=b)"), "Lookahead is not supported"),
    (StructuredOutput("regex", ""), "empty"),
    (StructuredOutput("choice", "[]"), "empty"),
    (StructuredOutput("choice", json.dumps(["a", 1])), "list of strings"),
]


@pytest.mark.parametrize("spec,why", BAD_SPECS, ids=[f"{s.kind}-{i}" for i, (s, _) in enumerate(BAD_SPECS)])
def test_bad_specs_are_refused_with_a_clear_message(engine, spec, why):
    label = {"json_schema": "response_format json_schema: ", "regex": "structured output regex: ",
             "choice": "structured output choice: "}[spec.kind]
    with pytest.raises(StructuredOutputError) as caught:
        engine.compile_structured(spec)
    message = str(caught.value)
    assert message.startswith(label) and why in message, message
    assert ".cc" not in message and "Traceback" not in message and "\n" not in message
    with pytest.raises(RequestError, match=re.escape(message)):
        engine.add_request("bad-spec", "hi", SamplingParams(structured=spec))
    assert "bad-spec" not in engine.requests and not engine.has_unfinished()


def test_logit_bias_ids_outside_the_vocabulary_are_refused(engine):
    vocab = engine.model.config.vocab_size
    with pytest.raises(RequestError, match=f"logit_bias names token id {vocab},"):
        engine.add_request("bias", "hi", SamplingParams(logit_bias={5: 1.0, vocab: 2.0}))
    assert not engine.has_unfinished()


def test_grammar_cache_compiles_once_across_threads_and_stays_bounded(tokenizer):
    cache = GrammarCache(tokenizer, len(tokenizer), [2], max_entries=4)
    calls = []
    real = cache._compile
    cache._compile = lambda spec: calls.append(spec) or real(spec)
    spec = schema_spec(SCHEMAS[21])
    results, start = [], threading.Barrier(8)

    def worker():
        start.wait()
        results.append(cache.compile(spec))

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(results) == 8 and all(r is results[0] for r in results)
    for i in range(10):
        cache.compile(StructuredOutput("regex", f"a{{{i + 1}}}"))
    assert len(cache) == 4
    bad = StructuredOutput("regex", "(")
    for _ in range(2):  # a refusal is cached too
        with pytest.raises(StructuredOutputError):
            cache.compile(bad)
    assert sum(1 for s in calls if s == bad) == 1


def test_async_engine_compiles_structured_output_off_the_engine_thread(tiny_dir, tokenizer):
    engine = AsyncEngine(make_engine(tiny_dir, tokenizer))
    try:
        spec = StructuredOutput("choice", json.dumps(["up", "down"]))
        engine.compile_structured(spec)
        assert engine.engine.grammars.compile(spec) is not None
        with pytest.raises(StructuredOutputError, match="the list of choices is empty"):
            engine.compile_structured(StructuredOutput("choice", "[]"))
    finally:
        engine.shutdown()


class _RecordingSampler(Sampler):
    """Keeps the logits of every call, to recompute what the sampler reports."""

    def __init__(self):
        super().__init__()
        self.seen: list[torch.Tensor] = []

    def __call__(self, logits, rows, generators, mask=None):
        self.seen.append(logits.clone())
        return super().__call__(logits, rows, generators, mask)


@pytest.mark.parametrize("structured", [None, StructuredOutput("regex", "[a-z ]{5,40}")], ids=["plain", "regex"])
def test_top_logprobs_are_the_raw_distributions_top_k(tiny_dir, tokenizer, structured):
    engine = make_engine(tiny_dir, tokenizer)
    engine.sampler = recorder = _RecordingSampler()
    params = SamplingParams(max_tokens=12, ignore_eos=True, top_logprobs=5, temperature=0.8, seed=3,
                            structured=structured)
    engine.add_request("top", "The weather", params)
    steps = []
    while engine.has_unfinished():
        steps += engine.step()
    final = steps[-1]
    assert final.finished and len(final.top_logprobs) == len(final.token_ids) == len(recorder.seen)
    for i, (logits, top) in enumerate(zip(recorder.seen, final.top_logprobs)):
        ref = torch.log_softmax(logits[0].double(), -1)
        values, ids = ref.topk(5)
        assert len(top) == 5 and [t for t, _ in top] == ids.tolist()
        assert torch.allclose(torch.tensor([v for _, v in top], dtype=torch.float64), values, atol=1e-4)
        assert abs(final.logprobs[i] - ref[final.token_ids[i]].item()) < 1e-4
    # Intermediate outputs: per-step entries and the state so far (a view), like logprobs.
    assert [e for out in steps for e in out.new_top_logprobs] == final.top_logprobs
    assert all(len(out.top_logprobs) == len(out.token_ids) for out in steps)
    plain = run_to_completion(engine, [("The weather", SamplingParams(max_tokens=4), None)])[0]
    assert plain.top_logprobs == [] and plain.new_top_logprobs == []


def test_top_logprobs_with_speculation_match_plain_decoding(tiny_dir, tokenizer):
    params = SamplingParams(max_tokens=30, ignore_eos=True, top_logprobs=3)
    prompt = "one two three four one two three four one two"
    outs = [run_to_completion(make_engine(tiny_dir, tokenizer, speculative_tokens=k), [(prompt, params, None)])[0]
            for k in (0, 4)]
    assert outs[0].token_ids == outs[1].token_ids
    for a, b in zip(outs[0].top_logprobs, outs[1].top_logprobs):
        assert [t for t, _ in a] == [t for t, _ in b]
        assert max(abs(x - y) for (_, x), (_, y) in zip(a, b)) < 1e-4


def test_logit_bias_forces_and_bans_tokens(engine, tokenizer):
    prompt = "The cat sat on the"
    base = run_to_completion(engine, [(prompt, SamplingParams(max_tokens=6, ignore_eos=True), None)])[0]
    forced_token = tokenizer.encode(" banana")[0]
    forced = run_to_completion(engine, [(prompt, SamplingParams(max_tokens=6, ignore_eos=True,
                                                                logit_bias={forced_token: 100}), None)])[0]
    assert forced.token_ids == [forced_token] * 6
    banned = run_to_completion(engine, [(prompt, SamplingParams(max_tokens=6, ignore_eos=True,
                                                                logit_bias={base.token_ids[0]: -100}), None)])[0]
    assert banned.token_ids[0] != base.token_ids[0] and base.token_ids[0] not in banned.token_ids
    # Reported logprobs stay the model's own (a bias changes the choice, not the distribution reported).
    assert banned.logprobs[0] < base.logprobs[0]
    # The grammar outranks a bias: +100 on a token the grammar forbids changes nothing.
    spec = StructuredOutput("choice", json.dumps(["left", "right"]))
    out = run_to_completion(engine, [(prompt, SamplingParams(max_tokens=10, structured=spec,
                                                             logit_bias={forced_token: 100}), None)])[0]
    assert out.text in ("left", "right")


def unpack(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """The bool [rows, vocab] of a packed token bitmask."""
    bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab].bool()


def test_packed_masks_round_trip_and_mask_only_their_rows():
    torch.manual_seed(0)
    vocab = 1000  # not a multiple of 32
    allowed = torch.rand(3, vocab) < 0.3
    allowed[:, [0, 31, 32, 999]] = True  # word edges and the sign bit
    packed = pack_mask(allowed)
    assert packed.dtype == torch.int32 and packed.shape == (3, 32) and torch.equal(unpack(packed, vocab), allowed)
    assert torch.equal(unpack(allocate_mask(2, vocab), vocab), torch.ones(2, vocab, dtype=torch.bool))
    logits = torch.randn(3, vocab)
    masked = logits.clone()
    apply_mask_(masked, packed, [0, 2])
    assert torch.equal(masked[1], logits[1])
    for i in (0, 2):
        assert torch.equal(masked[i].isinf(), ~allowed[i]) and torch.equal(masked[i][allowed[i]], logits[i][allowed[i]])


def test_json_masks_keep_raw_control_characters_out_of_strings(engine, tokenizer):
    """xgrammar lets a raw tab or other control character into a JSON string with a length bound, where JSON
    forbids it: the engine masks such tokens for the JSON kinds."""
    vocab = engine.model.config.vocab_size
    controls = [tokenizer.convert_tokens_to_ids(t) for t in ("ĉ", "ğ")]  # byte-level BPE "\t", "\x1f"
    assert [tokenizer.decode([t]) for t in controls] == ["\t", "\x1f"]
    newline = tokenizer.convert_tokens_to_ids("Ċ")
    for spec in (StructuredOutput("json_schema", json.dumps({"type": "string", "maxLength": 9})),
                 StructuredOutput("json_object")):
        constraint = Constraint(engine.grammars, spec)
        assert constraint.accept(tokenizer.encode('{"' if spec.kind == "json_object" else '"')[0])
        if spec.kind == "json_schema":
            raw = allocate_mask(1, vocab)
            constraint.matcher.fill_mask(raw)
            assert unpack(raw, vocab)[0, controls].all()  # what xgrammar alone would allow
        assert not unpack(constraint.mask, vocab)[0, [*controls, newline]].any()
        assert unpack(constraint.mask, vocab)[0, tokenizer.encode("abc")[0]]
    regex = Constraint(engine.grammars, StructuredOutput("regex", "a\\tb"))  # a regex keeps what it says
    assert regex.accept(tokenizer.encode("a")[0]) and unpack(regex.mask, vocab)[0, controls[0]]
