"""`POST /v1/chat/completions`: OpenAI's chat completions, with structured output (`response_format`),
tool calls, `n` choices and top logprobs. See `loramux.server.routes.openai_api` for models and extras."""
from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import Field

from loramux.engine.outputs import RequestOutput
from loramux.server.deps import PipelineDep, ServicesDep, TenantDep
from loramux.server.http.errors import ApiError
from loramux.server.http.sse import DONE, STREAMED, sse_event
from loramux.server.intake.body_prechecks import PrecheckedRoute
from loramux.server.intake.generation import Intake, RouteDefaults
from loramux.server.intake.params import ChatMessage
from loramux.server.intake.prompts import Prompt, renders_tools
from loramux.server.intake.response_format import ResponseFormat, from_response_format
from loramux.server.intake.tags import TAGS_HEADER, request_tags
from loramux.server.intake.tool_calls import (
    MAX_TOOLS,
    Tool,
    ToolChoice,
    ToolPlan,
    parse_calls,
    plan_tools,
    template_messages,
    with_tool_prompt,
)
from loramux.server.routes.chat_stream import ChoiceStream
from loramux.server.routes.openai_common import (
    DEFAULT_TEMPERATURE,
    OpenAIParams,
    chat_logprobs,
    check_n,
    final_json,
    finish_reason,
    logprobs_in_one_answer,
    refuse_given,
    usage,
)
from loramux.server.routes.responses import respond
from loramux.tenancy.tenants import TierInfo

router = APIRouter(route_class=PrecheckedRoute)

# max_tokens when the client gives none (capped by the room left in the context)
DEFAULTS = RouteDefaults("chatcmpl", max_tokens=1024, temperature=DEFAULT_TEMPERATURE)
# Fields OpenAI has that this server refuses (400), with what to do instead; never silently ignored.
REFUSED = {"functions": "use `tools`", "function_call": "use `tool_choice`",
           "audio": "this model writes text only", "prediction": "send the request without it",
           "web_search_options": "this server has no web search"}


class ChatCompletionRequest(OpenAIParams):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = Field(default=False, description="return each generated token's logprob")
    top_logprobs: int | None = Field(default=None, ge=0, le=20, description="with logprobs: also the k most "
                                     "likely tokens at each position (raw log-softmax of the model)")
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS, description="functions the model may call")
    tool_choice: ToolChoice | None = Field(
        default=None, description='"auto" (default with tools: the model decides), "none", "required" (some call) '
                                  'or {"type": "function", "function": {"name"}}; a forced call follows the '
                                  "function's parameters schema")
    parallel_tool_calls: bool = Field(default=True, description="allow several calls in one answer")
    modalities: list[str] | None = Field(default=None, description='only ["text"]')
    functions: list[Any] | None = Field(default=None, description="legacy: not supported (400), use tools")
    function_call: Any = Field(default=None, description="legacy: not supported (400), use tool_choice")
    audio: Any = Field(default=None, description="not supported (400)")
    prediction: Any = Field(default=None, description="not supported (400)")
    web_search_options: Any = Field(default=None, description="not supported (400)")


def _check(body: ChatCompletionRequest, tier: TierInfo, max_n: int) -> None:
    refuse_given(body, REFUSED)
    if body.modalities not in (None, ["text"]):
        raise ApiError(400, 'modalities other than ["text"] are not supported: this model writes text only',
                       code="unsupported_parameter", param="modalities")
    check_n(body.n, tier, max_n)
    if body.top_logprobs and not body.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", code="invalid_parameter", param="top_logprobs")


def _prompt(body: ChatCompletionRequest, plan: ToolPlan | None, engine) -> Prompt:
    """The messages (and tools) as the chat template takes them; tokenized once admitted."""
    native = plan is not None and renders_tools(engine)
    messages = template_messages(body.messages, native)
    if plan is None:
        return Prompt(messages=messages)
    if native:
        return Prompt(messages=messages, tools=[t.model_dump(exclude_none=True) for t in plan.tools])
    return Prompt(messages=with_tool_prompt(messages, plan))


@router.post("/chat/completions", responses=STREAMED)
async def chat_completions(body: ChatCompletionRequest, request: Request, services: ServicesDep, tenant: TenantDep,
                           pipeline: PipelineDep):
    arrival = time.monotonic()
    _check(body, tenant.tier, services.settings.max_n)
    plan = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls)
    structured = from_response_format(body.response_format)
    if plan is not None and structured is not None:
        raise ApiError(400, "response_format cannot be combined with tools: drop one, or describe the format in "
                            "a tool's parameters", code="invalid_response_format", param="response_format")
    engine = services.engine
    prompt = _prompt(body, plan, engine)
    if plan is None:
        constraints = [(structured, None)]
    else:  # a forced call follows the tools' schema; with "auto" it is compiled only to check the tools
        calls = plan.structured()
        constraints = [(calls, "tools' parameters schema")]
        structured = calls if plan.forced else None
    top = (body.top_logprobs or 0) if body.logprobs else 0
    running = await pipeline.start_generation(tenant, Intake(
        body.model, prompt, body, arrival, DEFAULTS, max_tokens=body.max_completion_tokens or body.max_tokens,
        n=body.n, sampling={"structured": structured, "top_logprobs": top},
        logprobs_per_token=logprobs_in_one_answer(body.logprobs, top, body.stream), constraints=constraints,
        models=body.models, tags=request_tags(request.headers.get(TAGS_HEADER), body.metadata)))

    def choice(index: int, out: RequestOutput) -> dict:
        calls = parse_calls(out.text, plan) if plan is not None and out.finish_reason == "stop" else None
        message = {"role": "assistant", "content": None if calls else out.text}
        if calls:
            message["tool_calls"] = calls
        logprobs = ({"content": chat_logprobs(engine, out.token_ids, out.logprobs, out.top_logprobs)}
                    if body.logprobs else None)
        return {"index": index, **running.choice_fields(index), "message": message, "logprobs": logprobs,
                "finish_reason": "tool_calls" if calls else finish_reason(out)}

    def final(outs: list[RequestOutput]) -> JSONResponse:
        return final_json(running, {"object": "chat.completion", "model": body.model,
                                    "choices": [choice(i, out) for i, out in enumerate(outs)]})

    async def events():
        base = {"id": running.request_id, "object": "chat.completion.chunk", "created": int(time.time()),
                "model": body.model}

        def chunk(index: int, delta: dict, logprobs: list | None = None, reason: str | None = None) -> str:
            return sse_event({**base, "choices": [{"index": index, **running.choice_fields(index), "delta": delta,
                                                   "finish_reason": reason,
                                                   "logprobs": None if logprobs is None else {"content": logprobs}}]})

        streams = [ChoiceStream(plan) for _ in range(running.n)]
        for i in range(running.n):  # a forced call has no content, as OpenAI streams it
            yield chunk(i, {"role": "assistant", "content": None if streams[i].mode == "call" else ""})
        async for i, out in running.choice_outputs():
            lp = (chat_logprobs(engine, out.new_token_ids, out.new_logprobs, out.new_top_logprobs)
                  if body.logprobs and out.new_token_ids else None)
            deltas = streams[i].feed(out.delta_text, lp)
            if out.finished:
                deltas += streams[i].finish()
            for delta, logprobs in deltas:
                yield chunk(i, delta, logprobs)
        # Every choice's finish after the request is billed; the last one carries usage and the extension.
        reasons = ["tool_calls" if stream.tool_calls else finish_reason(out)
                   for stream, out in zip(streams, running.lasts)]
        for i, reason in enumerate(reasons[:-1]):
            yield chunk(i, {}, reason=reason)
        yield sse_event({**base, "choices": [{"index": running.n - 1, **running.choice_fields(running.n - 1),
                                              "delta": {}, "logprobs": None, "finish_reason": reasons[-1]}],
                         "usage": usage(running), "loramux": running.extension(running.lasts[0])})
        if body.stream_options and body.stream_options.include_usage:
            yield sse_event({**base, "choices": [], "usage": usage(running)})
        yield DONE

    return await respond(request, running, stream=body.stream, final=final, events=events)
