"""Self-distillation data: the served model's own greedy answers to a prompt set, as token ids.

Speculators are trained to predict what the target model will say, so the best training text is the target's
own output (Medusa's "self-distillation", and the standard recipe for draft models): no dataset to download,
and an adapter's speculator learns that adapter's answers.
"""
from __future__ import annotations

from dataclasses import dataclass

from tqdm import tqdm

from loramux.engine.sampling.params import SamplingParams

__all__ = ["Conversation", "self_distilled"]


@dataclass
class Conversation:
    prompt_ids: list[int]  # the chat-templated prompt
    answer_ids: list[int]  # the model's greedy answer (its end-of-turn token included when it stopped)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.answer_ids


def self_distilled(engine, prompts: list[str | list[int]], max_tokens: int = 128, adapter: str | None = None,
                   progress: bool = True) -> list[Conversation]:
    """The engine's greedy answers to `prompts` (text is chat-templated as a user turn; token ids are taken as
    they are), with `adapter` (a registered name) or the base model; requests run as one continuous batch.
    Speculation is off for these requests (it changes nothing in greedy output, and the speculators being
    trained do not exist yet)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, speculative=False)
    ids = {}
    for i, prompt in enumerate(prompts):
        rid = f"distill-{i}"
        prompt_ids = engine.encode_chat([{"role": "user", "content": prompt}]) if isinstance(prompt, str) else prompt
        engine.add_request(rid, prompt_ids, params, adapter=adapter)
        ids[rid] = prompt_ids
    answers: dict[str, list[int]] = {}
    with tqdm(total=len(prompts), desc="answers", unit="prompt", disable=not progress) as bar:
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    answers[out.request_id] = list(out.token_ids)
                    bar.update(1)
    return [Conversation(ids[rid], answers[rid]) for rid in ids]
