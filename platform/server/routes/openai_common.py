"""What the OpenAI routes share: the common request fields, usage, the final JSON answer, and logprobs in
OpenAI's two shapes (chat's `content` entries, completions' parallel lists)."""
from __future__ import annotations

import time
from collections.abc import Sequence

from fastapi.responses import JSONResponse
from pydantic import Field

from loramux.engine.outputs import RequestOutput
from loramux.server.http.bodies import RequestBody
from loramux.server.http.errors import ApiError
from loramux.server.intake.params import GenerationParams
from loramux.server.serving.running import Running
from loramux.tenancy.tenants import TierInfo

DEFAULT_TEMPERATURE = 1.0  # OpenAI's default


class StreamOptions(RequestBody):
    include_usage: bool = Field(default=False, description="end the stream with a chunk that carries the usage "
                                                           "(and no choices)")


class OpenAIParams(GenerationParams):
    model: str = Field(min_length=1, max_length=300)
    n: int = Field(default=1, ge=1, description="how many choices to generate, at most the tier's "
                                                "max_choices (free 2, standard 8, premium 16 by default) and "
                                                "LORAMUX_MAX_N (16); 400 above. The choices share the "
                                                "prompt's KV blocks; with a seed, choice i samples with seed + i")
    stream_options: StreamOptions | None = None
    models: list[str] | None = Field(
        default=None, description="fan-out (an extension): the same prompt to each of these adapters (or the base "
                                  "model) in one call, one choice per adapter with its `model`; at most the "
                                  "tier's max_fanout (free 2, standard 8, premium 16) and LORAMUX_MAX_FANOUT (16); "
                                  "`model` must be the base model or models[0], n must be 1, no adapter twice")


def check_n(n: int, tier: TierInfo, server_max_n: int) -> None:
    """400 for more choices than the tenant's tier allows (`max_choices`) or the server's cap (LORAMUX_MAX_N)."""
    if n > min(tier.max_choices, server_max_n):
        whose = (f"tier {tier.name!r} allows" if tier.max_choices <= server_max_n else "this server allows")
        limit = min(tier.max_choices, server_max_n)
        raise ApiError(400, f"n={n}: {whose} at most {limit} choices per request; ask for at most {limit} "
                            "(or send several requests)", code="invalid_n", param="n")


def logprobs_in_one_answer(wanted: bool, top: int, stream: bool) -> int:
    """Logprob entries per generated token that one JSON answer holds (the token's own and its `top`
    alternatives), for `check_logprob_volume`; 0 without logprobs, and 0 for a stream, whose chunks carry
    each step's few entries as they come."""
    return top + 1 if wanted and not stream else 0


def unsupported(what: str, fix: str, param: str | None = None) -> ApiError:
    return ApiError(400, f"{what} is not supported by this server; {fix}", code="unsupported_parameter", param=param)


def refuse_given(body, fields: dict[str, str]) -> None:
    """400 for the first of `fields` (name -> how to do without it) that the request set."""
    for name, fix in fields.items():
        if getattr(body, name) is not None:
            raise unsupported(f"`{name}`", fix, name)


def finish_reason(out: RequestOutput | None) -> str:
    return (out.finish_reason if out is not None else None) or "cancelled"


def usage(running: Running) -> dict:
    """OpenAI's usage: the prompt once, completion tokens of every choice, and the prompt's cached tokens
    (what choice 0, which computed the shared prompt, found in the prefix cache). A fan-out counts the prompt
    and its cached tokens once per adapter: the sum of its ledger rows."""
    completion = sum(len(o.token_ids) for o in running.lasts if o is not None)
    prompt = running.billed_prompt_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": running.cached_tokens}}


def final_json(running: Running, body: dict) -> JSONResponse:
    """A non-streamed answer: OpenAI's fields + usage + the loramux extension, with the timing headers."""
    out = running.lasts[0]
    return JSONResponse({"id": running.request_id, "created": int(time.time()), **body, "usage": usage(running),
                         "system_fingerprint": None, "loramux": running.extension(out)},
                        headers={**running.headers(), **timing_headers(out)})


def timing_headers(out: RequestOutput) -> dict[str, str]:
    t = out.timings
    named = (("X-Loramux-Queue-Ms", "queue_ms"), ("X-Loramux-TTFT-Ms", "ttft_ms"), ("X-Loramux-Total-Ms", "total_ms"))
    return {header: f"{t[key]:.1f}" for header, key in named if t.get(key) is not None}


def _texts(engine, ids: Sequence[int], tops: Sequence[list[tuple[int, float]]]) -> dict[int, str]:
    """Each token's own text, for the chosen tokens and their alternatives (one decode per distinct id)."""
    unique = list(dict.fromkeys([*ids, *(t for top in tops for t, _ in top)]))
    return dict(zip(unique, engine.token_texts(unique)))


def chat_logprobs(engine, ids: Sequence[int], logprobs: Sequence[float],
                  tops: Sequence[list[tuple[int, float]]] = ()) -> list[dict]:
    """Chat's `logprobs.content`: per token its text, logprob, bytes and `top_logprobs` (the k most likely
    tokens of the raw distribution, most likely first; [] when none were asked for)."""
    texts = _texts(engine, ids, tops)

    def entry(token_id: int, logprob: float) -> dict:
        text = texts[token_id]
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return [{**entry(t, lp), "top_logprobs": [entry(a, alp) for a, alp in (tops[i] if i < len(tops) else ())]}
            for i, (t, lp) in enumerate(zip(ids, logprobs))]


def completion_logprobs(engine, ids: Sequence[int], logprobs: Sequence[float | None],
                        tops: Sequence[list[tuple[int, float]]] | None, offset: int = 0) -> dict:
    """Completions' `logprobs`: `tokens`, `token_logprobs`, `top_logprobs` (per position {text: logprob}
    of the k most likely tokens, or null without k) and `text_offset` (from `offset`, the characters
    before the first token). A logprob of None (an echoed prompt token) stays null, as has its top."""
    texts = _texts(engine, ids, tops or ())
    tokens = [texts[t] for t in ids]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    top = None
    if tops is not None:
        top = []
        for i, lp in enumerate(logprobs):
            alternatives: dict[str, float] = {}
            for a, alp in tops[i] if lp is not None and i < len(tops) else ():
                alternatives.setdefault(texts[a], alp)  # two ids with one text: the likelier one's
            top.append(None if lp is None else alternatives)
    return {"tokens": tokens, "token_logprobs": list(logprobs), "top_logprobs": top, "text_offset": offsets}


def joined(first: dict, second: dict) -> dict:
    """Two completions `logprobs` blocks as one (the echoed prompt's, then the generated text's)."""
    top = None if first["top_logprobs"] is None and second["top_logprobs"] is None else \
        [*(first["top_logprobs"] or [None] * len(first["tokens"])), *(second["top_logprobs"] or
                                                                     [None] * len(second["tokens"]))]
    return {"tokens": first["tokens"] + second["tokens"],
            "token_logprobs": first["token_logprobs"] + second["token_logprobs"], "top_logprobs": top,
            "text_offset": first["text_offset"] + second["text_offset"]}
