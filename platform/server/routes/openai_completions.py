"""`POST /v1/completions`: OpenAI's legacy text completions, with `n` choices, top logprobs, `echo` and
structured output (`response_format`, an extension here). See `loramux.server.routes.openai_api`."""
from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import Field

from loramux.engine.outputs import RequestOutput
from loramux.server.deps import PipelineDep, ServicesDep, TenantDep
from loramux.server.http.errors import ApiError
from loramux.server.http.sse import DONE, STREAMED, sse_event
from loramux.server.intake.body_prechecks import PrecheckedRoute
from loramux.server.intake.generation import Intake, RouteDefaults
from loramux.server.intake.params import MAX_TOP_LOGPROBS
from loramux.server.intake.prompts import Prompt, decode
from loramux.server.intake.response_format import ResponseFormat, from_response_format
from loramux.server.intake.tags import TAGS_HEADER, request_tags
from loramux.server.routes.openai_common import (
    DEFAULT_TEMPERATURE,
    OpenAIParams,
    check_n,
    completion_logprobs,
    final_json,
    finish_reason,
    joined,
    logprobs_in_one_answer,
    unsupported,
    usage,
)
from loramux.server.routes.responses import respond
from loramux.server.serving.running import Running

router = APIRouter(route_class=PrecheckedRoute)

DEFAULTS = RouteDefaults("cmpl", max_tokens=16, temperature=DEFAULT_TEMPERATURE)  # max_tokens: OpenAI's default


class CompletionRequest(OpenAIParams):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        description="text or token ids; a list of prompts is refused (400): send one prompt per request")
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS,
                                 description="each token's logprob, and with k > 0 the k most likely tokens at each "
                                             "position (up to 20, as top_logprobs on chat; OpenAI stops at 5)")
    echo: bool = Field(default=False, description="prepend the prompt to each choice's text (and with logprobs "
                                                  "its tokens, whose logprobs are null: they are not computed)")
    response_format: ResponseFormat | None = None
    suffix: str | None = Field(default=None, description="not supported (400)")
    best_of: int | None = Field(default=None, ge=1, description="not supported above n (400); use n")


def _prompt(body: CompletionRequest) -> Prompt:
    if body.suffix:
        raise unsupported("suffix", "this model does no insertion; put everything in `prompt`", "suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise unsupported("best_of", "ask for `n` choices and pick among them", "best_of")
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise ApiError(400, "batched prompts are not supported: send one prompt per request",
                           code="unsupported_parameter", param="prompt")
        prompt = prompt[0]
    if not prompt:
        raise ApiError(400, "prompt must not be empty", param="prompt")
    return Prompt(text=prompt) if isinstance(prompt, str) else Prompt(token_ids=list(prompt))


class _Echo:
    """The prompt as each choice's text begins with it (`echo`): its text, and its tokens' logprobs entry."""

    def __init__(self, engine, prompt: Prompt, running: Running, logprobs: int | None):
        self.text = prompt.text if prompt.text is not None else decode(engine, running.prompt_ids)
        ids = running.prompt_ids
        self.logprobs = None if logprobs is None else completion_logprobs(
            engine, ids, [None] * len(ids), [[]] * len(ids) if logprobs else None)


@router.post("/completions", responses=STREAMED)
async def completions(body: CompletionRequest, request: Request, services: ServicesDep, tenant: TenantDep,
                      pipeline: PipelineDep):
    arrival = time.monotonic()
    check_n(body.n, tenant.tier, services.settings.max_n)
    prompt = _prompt(body)
    structured = from_response_format(body.response_format)
    engine = services.engine
    want_logprobs, k = body.logprobs is not None, body.logprobs or 0
    running = await pipeline.start_generation(tenant, Intake(
        body.model, prompt, body, arrival, DEFAULTS, max_tokens=body.max_tokens, n=body.n,
        sampling={"structured": structured, "top_logprobs": k}, constraints=[(structured, None)],
        logprobs_per_token=logprobs_in_one_answer(want_logprobs, k, body.stream), models=body.models,
        tags=request_tags(request.headers.get(TAGS_HEADER), body.metadata)))
    echo = _Echo(engine, prompt, running, body.logprobs) if body.echo else None
    before = len(echo.text) if echo else 0  # characters ahead of the generated text

    def logprobs_of(ids, logprobs, tops, offset: int, first: bool) -> dict | None:
        if not want_logprobs:
            return None
        generated = completion_logprobs(engine, ids, logprobs, tops if k else None, offset)
        return joined(echo.logprobs, generated) if first and echo else generated

    def final(outs: list[RequestOutput]) -> JSONResponse:
        choices = [{"index": i, **running.choice_fields(i), "text": (echo.text if echo else "") + out.text,
                    "finish_reason": finish_reason(out),
                    "logprobs": logprobs_of(out.token_ids, out.logprobs, out.top_logprobs, before, True)}
                   for i, out in enumerate(outs)]
        return final_json(running, {"object": "text_completion", "model": body.model, "choices": choices})

    async def events():
        base = {"id": running.request_id, "object": "text_completion", "created": int(time.time()),
                "model": body.model}
        offsets = [before] * running.n  # characters of each choice's text sent so far
        started = [False] * running.n
        async for i, out in running.choice_outputs():
            first = not started[i]
            if out.delta_text or (want_logprobs and out.new_token_ids) or (first and echo):
                lp = logprobs_of(out.new_token_ids, out.new_logprobs, out.new_top_logprobs, offsets[i], first)
                text = (echo.text if first and echo else "") + out.delta_text
                started[i] = True
                offsets[i] += len(out.delta_text)
                yield sse_event({**base, "choices": [{"index": i, **running.choice_fields(i), "text": text,
                                                      "logprobs": lp, "finish_reason": None}]})
        for i in range(running.n):
            event = {**base, "choices": [{"index": i, **running.choice_fields(i), "text": "", "logprobs": None,
                                          "finish_reason": finish_reason(running.lasts[i])}]}
            if i == running.n - 1:
                event.update(usage=usage(running), loramux=running.extension(running.lasts[0]))
            yield sse_event(event)
        if body.stream_options and body.stream_options.include_usage:
            yield sse_event({**base, "choices": [], "usage": usage(running)})
        yield DONE

    return await respond(request, running, stream=body.stream, final=final, events=events)
