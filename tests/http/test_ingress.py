"""A hostile client against a running server: nothing unauthenticated is read, bodies are capped while
they stream in, deep JSON is refused by a linear scan, and oversized prompts hit the rate limiter and
never the tokenizer."""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from conftest import live_stack, new_tenant_key
from loramux.model.loader import read_model_config
from loramux.server.http.ingress import json_depth_exceeds
from loramux.testing import write_peft_adapter

ADMIN_KEY = "lmxa-test-ingress-admin-key-0123456789abcdefghij"
MODEL = "SmolLM2-135M-Instruct"
MAX_REQUEST_BYTES = 128 * 1024  # small, so that a rank-32 adapter upload (256 KiB) is above it
HUGE = 200 * 1024**2
MiB = 1024**2


@pytest.fixture(scope="module")
def stack(tiny_dir, tokenizer, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ingress")
    with live_stack(tmp, tiny_dir, tokenizer, engine=dict(max_loras=2, max_lora_rank=8), admin_key=ADMIN_KEY,
                    max_request_bytes=MAX_REQUEST_BYTES, max_upload_bytes=1 * MiB) as server:
        keys = {tier: new_tenant_key(server.services, f"{tier}-co", tier) for tier in ("free", "premium")}
        yield server, keys, tmp


def rss_bytes() -> int:
    """This process's resident memory (the server runs in it, on a thread)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def huge_body(sent: list[int], total: int = HUGE, chunk: int = MiB):
    """`total` bytes of a JSON-looking body, from one reused chunk (the client itself holds 1 MiB); counts
    into `sent[0]` the bytes handed to the connection."""
    piece = b"[" * chunk
    for _ in range(total // chunk):
        sent[0] += chunk
        yield piece


def post_huge(url: str, headers: dict[str, str], declare_length: bool) -> tuple[int | None, int]:
    """POST a 200 MB body; the status (None when the server cut the connection before any answer could be
    read) and how many of its bytes the client had handed over by then (a server that does not read the
    body stops it after the socket buffers fill)."""
    if declare_length:
        headers = {**headers, "Content-Length": str(HUGE)}
    sent = [0]
    try:
        with httpx.Client(timeout=30) as c:
            status = c.post(url, content=huge_body(sent), headers={"Content-Type": "application/json", **headers}
                            ).status_code
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError):
        status = None
    return status, sent[0]


@pytest.mark.parametrize("declare_length", [False, True], ids=["chunked", "content-length"])
@pytest.mark.parametrize(("path", "who", "expected"), [
    ("/v1/chat/completions", None, 401),
    ("/generate", None, 401),
    ("/admin/adapters", None, 401),  # the upload route: its own cap applies only once the key is known
    ("/admin/tenants", None, 401),
    ("/v1/chat/completions", "premium", 413),
    ("/admin/tenants", "admin", 413),
])
def test_a_huge_body_is_refused_fast_without_being_read(stack, path, who, expected, declare_length):
    server, keys, _ = stack
    headers = {}
    if who is not None:
        headers["Authorization"] = f"Bearer {ADMIN_KEY if who == 'admin' else keys[who]}"
    assert httpx.get(f"{server.url}/health").status_code == 200  # warm: connections, threads
    before = rss_bytes()
    status, sent = post_huge(f"{server.url}{path}", headers, declare_length)
    grown = rss_bytes() - before
    print(f"{path} as {who}, {'Content-Length' if declare_length else 'chunked'}: {status} after "
          f"{sent / MiB:.0f} MB sent, RSS +{grown / MiB:.1f} MB")
    assert status == expected
    assert sent <= 32 * MiB, sent  # of 200: refused before the rest was sent, never read to the end
    assert grown < 50 * MiB
    health = httpx.get(f"{server.url}/health", timeout=5)
    assert health.status_code == 200


def test_refusals_have_the_openai_shape_and_close_an_unread_body(stack):
    server, keys, _ = stack
    resp = httpx.post(f"{server.url}/v1/chat/completions", content=b"x" * (MAX_REQUEST_BYTES + 1),
                      headers={"Authorization": f"Bearer {keys['premium']}", "Content-Type": "application/json"})
    assert resp.status_code == 413 and resp.headers["connection"] == "close"
    error = resp.json()["error"]
    assert error["code"] == "request_body_too_large" and str(MAX_REQUEST_BYTES) in error["message"]
    assert error["type"] == "invalid_request_error"
    resp = httpx.post(f"{server.url}/v1/completions", content=b"{}")
    assert resp.status_code == 401 and resp.headers["www-authenticate"] == "Bearer"
    assert resp.json()["error"]["type"] == "authentication_error"


@pytest.mark.parametrize(("path", "message"), [
    ("/v1/chat/completions", "missing API key"),
    ("/v1/completions", "missing API key"),
    ("/generate", "missing API key"),
    ("/admin/tenants", "missing admin key"),
    ("/v1/does-not-exist", "missing API key"),
])
def test_malformed_json_without_a_key_is_401(stack, path, message):
    server, _, _ = stack
    resp = httpx.post(f"{server.url}{path}", content=b"{", headers={"Content-Type": "application/json"})
    assert resp.status_code == 401, resp.text
    assert message in resp.json()["error"]["message"]


def test_wrong_kind_of_key_is_403_before_the_body(stack):
    server, keys, _ = stack
    as_admin = httpx.post(f"{server.url}/v1/chat/completions", content=b"{",
                          headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert as_admin.status_code == 403 and "admin keys are not accepted" in as_admin.text
    as_tenant = httpx.post(f"{server.url}/admin/tenants", content=b"{",
                           headers={"Authorization": f"Bearer {keys['free']}"})
    assert as_tenant.status_code == 403 and "tenant API keys are not accepted" in as_tenant.text
    assert httpx.get(f"{server.url}/openapi.json").status_code == 200  # the docs need no key


def test_uploads_keep_their_own_cap(stack, tiny_dir):
    """An adapter upload larger than max_request_bytes is accepted (its route caps it at max_upload_bytes)."""
    server, _, tmp = stack
    cfg, _ = read_model_config(tiny_dir)
    path = write_peft_adapter(tmp / "big", cfg, 32, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                      "up_proj", "down_proj"], seed=1)
    weights = (path / "adapter_model.safetensors").read_bytes()
    assert len(weights) > MAX_REQUEST_BYTES
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    tenant = httpx.post(f"{server.url}/admin/tenants", json={"name": "uploader"}, headers=admin).json()
    files = {"adapter_config": ("adapter_config.json", (path / "adapter_config.json").read_bytes()),
             "adapter_model": ("adapter_model.safetensors", weights)}
    resp = httpx.post(f"{server.url}/admin/adapters", data={"tenant_id": tenant["id"], "name": "big"}, files=files,
                      headers=admin, timeout=60)
    assert resp.status_code == 201, resp.text
    too_big = httpx.post(f"{server.url}/admin/adapters", content=b"x" * (3 * MiB), timeout=60,
                         headers={**admin, "Content-Type": "multipart/form-data; boundary=x"})
    assert too_big.status_code == 413 and "upload" in too_big.text


class CountingEncoder:
    """Stands in for AsyncEngine.encode / encode_chat and counts the calls."""

    def __init__(self, real):
        self.real = real
        self.calls = 0
        self.lock = threading.Lock()

    def __call__(self, *args):
        with self.lock:
            self.calls += 1
        return self.real(*args)


def test_oversized_prompts_hit_the_rate_limiter_and_never_the_tokenizer(stack, monkeypatch):
    server, _, _ = stack
    services = server.services
    engine = services.engine
    text_encoder, chat_encoder = CountingEncoder(engine.encode), CountingEncoder(engine.encode_chat)
    monkeypatch.setattr(engine, "encode", text_encoder)
    monkeypatch.setattr(engine, "encode_chat", chat_encoder)
    key = new_tenant_key(services, "flood-co", "free")  # 60 requests per minute
    headers = {"Authorization": f"Bearer {key}"}
    prompt = "lorem ipsum " * 8_500  # 102 KB: under the body cap, far over what 512 tokens of context can hold
    assert engine.max_chars_per_token and len(prompt) // engine.max_chars_per_token > engine.max_model_len
    bodies = [{"model": "base", "prompt": prompt, "max_tokens": 4},
              {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 4}]
    paths = ["/v1/completions", "/v1/chat/completions"]
    statuses, codes = [], set()
    start = time.monotonic()
    with httpx.Client(base_url=server.url, headers=headers, timeout=30) as c:
        for i in range(300):
            resp = c.post(paths[i % 2], json=bodies[i % 2])
            statuses.append(resp.status_code)
            codes.add(resp.json()["error"]["code"])
    elapsed = time.monotonic() - start
    refused_by_length, limited = statuses.count(400), statuses.count(429)
    print(f"300 oversized prompts in {elapsed:.2f} s: {refused_by_length} x 400, {limited} x 429, "
          f"{text_encoder.calls + chat_encoder.calls} tokenizations")
    assert set(statuses) == {400, 429} and codes == {"context_length_exceeded", "rate_limit_exceeded"}
    assert refused_by_length <= 60 + elapsed + 1  # the bucket's 60, plus what it refilled meanwhile
    assert limited >= 300 - 60 - elapsed - 1
    assert statuses[:60] == [400] * 60  # the first minute's worth, then 429s
    assert text_encoder.calls == 0 and chat_encoder.calls == 0
    # Every refusal gave its admission back: nothing is in flight.
    front = server.app.state.pipeline
    assert front.limiter.in_flight(services.tenancy.authenticate(key).tenant_id) == 0
    # The counters do see tokenization: a prompt that fits is tokenized once and served.
    other = new_tenant_key(services, "fits-co", "free")
    ok = httpx.post(f"{server.url}/v1/completions", json={"model": "base", "prompt": "hello", "max_tokens": 2},
                    headers={"Authorization": f"Bearer {other}"}, timeout=60)
    assert ok.status_code == 200 and text_encoder.calls == 1


def test_a_prompt_under_the_bound_but_over_the_context_is_still_refused(stack):
    """Tokenized (its bound fits), then refused on its real token count, and its admission given back."""
    server, keys, _ = stack
    prompt = "9 " * 2_000  # 4000 characters: at least ~50 tokens by the bound, ~2000 in fact
    resp = httpx.post(f"{server.url}/v1/completions", json={"model": "base", "prompt": prompt, "max_tokens": 2},
                      headers={"Authorization": f"Bearer {keys['premium']}"}, timeout=60)
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "context_length_exceeded", resp.text
    front, services = server.app.state.pipeline, server.services
    assert front.limiter.in_flight(services.tenancy.authenticate(keys["premium"]).tenant_id) == 0


def test_a_failed_tokenization_gives_its_admission_back(stack, monkeypatch):
    server, keys, _ = stack
    services = server.services

    def broken(messages, tools=None):
        raise ValueError("template exploded")

    monkeypatch.setattr(services.engine, "encode_chat", broken)
    key = new_tenant_key(services, "broken-co", "free")
    resp = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, headers={"Authorization": f"Bearer {key}"},
                      json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert resp.status_code == 400 and "chat template" in resp.text
    assert server.app.state.pipeline.limiter.in_flight(services.tenancy.authenticate(key).tenant_id) == 0


DEEP = 100_000  # deeper than any recursive parser or validator survives; the bodies stay under the 128 KiB cap


@pytest.mark.parametrize("body", [
    b"[" * DEEP,
    b"[" * (DEEP // 2 + 10_000) + b"]" * (DEEP // 2 + 10_000),
    b'{"a":' * (DEEP // 5) + b"1" + b"}" * (DEEP // 5),
    json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                "tools": json.loads("[" * 200 + "]" * 200)}).encode(),
], ids=["open-arrays", "closed-arrays", "objects", "deep-field"])
def test_deep_nesting_is_refused_cleanly(stack, body):
    server, keys, _ = stack
    resp = httpx.post(f"{server.url}/v1/chat/completions", content=body, timeout=30,
                      headers={"Authorization": f"Bearer {keys['premium']}", "Content-Type": "application/json"})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["code"] == "json_too_deep" and "64 levels" in error["message"]
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200  # the refusal left nothing running


def test_brackets_inside_strings_are_not_nesting(stack):
    server, keys, _ = stack
    content = "[{" * 100 + '\\"' + "}]" * 100  # 200 openers, all in one string (with an escaped quote)
    resp = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                      headers={"Authorization": f"Bearer {keys['premium']}"},
                      json={"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 2})
    assert resp.status_code == 200, resp.text


@pytest.mark.parametrize(("body", "deep"), [
    (b"[]", False),
    (b"[" * 64 + b"]" * 64, False),
    (b"[" * 65 + b"]" * 65, True),
    (b'{"a": "' + b"[" * 1000 + b'"}', False),
    (b'["\\"' + b"[" * 100 + b'"]', False),  # an escaped quote does not end the string
    (b'["\\\\"' + b", [" * 100 + b"]" * 100 + b"]", True),  # an escaped backslash does
    (b'"' + b"[" * 100, False),  # an unterminated string runs to the end
])
def test_json_depth_scan(body, deep):
    assert json_depth_exceeds(body, 64) is deep


@pytest.mark.parametrize("pathological", [b'"\\"' * 1_400_000, b'"\\' * 2_000_000, b"\\" * 4_000_000,
                                          b'[""' * 1_400_000, b"[" * 4_000_000])
def test_json_depth_scan_is_linear(pathological):
    """Inputs that make naive string regexes backtrack quadratically take well under a second of CPU (this
    thread's, so a busy machine does not count)."""
    start = time.thread_time()
    json_depth_exceeds(pathological, 64)
    assert time.thread_time() - start < 1.0


def test_max_chars_per_token_is_the_longest_token_where_every_character_is_covered(tokenizer):
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from loramux.engine.tokens import max_chars_per_token
    from loramux.server.intake.prompts import Prompt

    longest = max(map(len, tokenizer.get_vocab()))
    assert max_chars_per_token(tokenizer) == longest  # byte-level BPE (SmolLM2)
    text = "a fairly ordinary sentence, " * 50
    assert Prompt(text=text).min_tokens(longest) <= len(tokenizer.encode(text))

    def wrapped(model, pre_tokenizer=None, normalizer=None):
        tok = Tokenizer(model)
        if pre_tokenizer is not None:
            tok.pre_tokenizer = pre_tokenizer
        if normalizer is not None:
            tok.normalizer = normalizer
        return PreTrainedTokenizerFast(tokenizer_object=tok)

    vocab = {"[UNK]": 0, "a": 1, "ab": 2}
    # Whitespace splitting drops the spaces, WordPiece folds a whole unknown word into [UNK]: no bound.
    assert max_chars_per_token(wrapped(models.WordPiece(vocab, unk_token="[UNK]"), pre_tokenizers.Whitespace())) is None
    assert max_chars_per_token(wrapped(models.BPE({"a": 0, "b": 1, "ab": 2}, [("a", "b")]),
                                       pre_tokenizers.WhitespaceSplit())) is None
    assert max_chars_per_token(wrapped(models.BPE({"a": 0, "b": 1, "ab": 2}, [("a", "b")]),
                                       normalizer=normalizers.Strip())) is None
    assert max_chars_per_token(wrapped(models.BPE({"a": 0, "b": 1, "ab": 2}, [("a", "b")]),
                                       pre_tokenizers.Metaspace(),
                                       normalizers.Sequence([normalizers.Replace(" ", "\u2581")]))) == 2
    assert Prompt(token_ids=[1, 2, 3]).min_tokens(None) == 3 and Prompt(text="abc").min_tokens(None) == 0
    assert Prompt(messages=[{"role": "user", "content": "  abcd  "}]).min_tokens(2) == 2  # trimmed by templates
