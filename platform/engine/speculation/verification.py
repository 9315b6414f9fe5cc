"""Speculative decoding's shared parts: the prompt-lookup proposer, and verifying a sequence's draft (from
any proposer: `loramux.engine.speculation.speculator`) against the step's logits (`verify_draft`), on top of the pure
parts below.

Proposal (`propose_ngram`, plain Python): prompt lookup decoding, as HF's `prompt_lookup_num_tokens`
and vLLM's n-gram proposer. The last n tokens of the context (prompt + output so far) are looked up
earlier in the context; the tokens that followed that occurrence are the draft. No draft model.

Verification (`verify`, torch): the target model scores the context extended by the draft in one
forward pass, which gives the target distribution p_j at each of the len(draft) + 1 positions
(processed per row by `Sampler.probs`: penalties, temperature, top-k/p, min-p). Then, position by
position:

* greedy: draft[j] is accepted while it equals argmax(p_j); the token after the accepted prefix is
  the argmax at the first mismatch (the correction) or at the end (the bonus token). The output is
  exactly what plain greedy decoding produces.
* sampling (speculative sampling, Leviathan et al. 2023 / Chen et al. 2023): the proposal is a
  point mass q_j on draft[j], so draft[j] is accepted with probability min(1, p_j / q_j) =
  p_j[draft[j]]; on rejection the next token is drawn from the residual max(p_j - q_j, 0),
  normalised, which is p_j with draft[j] zeroed and renormalised; when every draft is accepted the
  bonus token is drawn from p_len(draft). The emitted tokens are distributed exactly as tokens
  sampled one at a time from the target.

Each verification step thus appends accepted + 1 tokens (1 .. len(draft) + 1). Random draws use the
request's generator (None: the global RNG of the tensors' device), so seeded requests reproduce.
"""

from __future__ import annotations

import dataclasses
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from loramux.engine.sampling.sampler import Sampler, SamplingRow, top_logprobs

if TYPE_CHECKING:
    from loramux.engine.sequence import Sequence as EngineSequence
    from loramux.engine.structured.constraint import Constraint

__all__ = ["Verdict", "verify_draft", "propose_ngram", "verify_greedy", "verify", "build_verdict"]

def verify_draft(seq: EngineSequence, logits: torch.Tensor, row: SamplingRow, sampler: Sampler,
                 generator: torch.Generator | None, constraint: Constraint | None
                 ) -> tuple[Verdict, list[list[tuple[int, float]]]]:
    """Verify `seq`'s draft: `logits` [len(draft) + 1, V] are the target model's at the draft's positions
    (early stops already masked), `row` the sequence's sampling row. Accepts the longest valid prefix of
    the draft (`verify`: rejection sampling keeps the distribution) plus one more token; returns the
    verdict and each emitted token's top logprobs. Clears the draft and counts in `seq.spec_misses` the
    verifications in a row that accepted nothing."""
    draft = seq.draft_token_ids
    rows = [dataclasses.replace(row, output_token_ids=seq.output_token_ids + draft[:j]) for j in range(len(draft) + 1)]
    mask = constraint.draft_masker(draft) if constraint is not None else None
    probs, raw_logprobs = sampler.probs(logits, rows, mask)
    accepted, next_token = verify(probs, draft, generator, greedy=seq.params.temperature < 1e-5)
    verdict = build_verdict(draft, accepted, next_token, raw_logprobs)
    top = top_logprobs(raw_logprobs[:accepted + 1], [seq.params.top_logprobs] * (accepted + 1))
    seq.spec_misses = seq.spec_misses + 1 if accepted == 0 else 0
    seq.draft_token_ids = []
    return verdict, top

_ITEM = array("i").itemsize


def propose_ngram(
    token_ids: Sequence[int],
    num_draft: int,
    max_ngram: int = 4,
    min_ngram: int = 1,
    window: int = 4096,
) -> list[int]:
    """Draft up to `num_draft` tokens by looking the context's last n-gram up earlier in it.

    For n from max_ngram down to min_ngram: find the most recent earlier occurrence of the last n
    tokens of `token_ids` (not the suffix itself; it may overlap it) lying wholly within the last
    `window` tokens, and return the up to `num_draft` tokens that followed it (fewer when it sits
    near the end; at least one). The longest matching n wins; no match gives [].

    Token ids must be ints in [-2**31, 2**31). The search runs in C (bytes.rfind over the int32
    encoding of the window), so it costs O(window) per call whatever the content.
    """
    if min_ngram < 1:
        raise ValueError(f"min_ngram must be >= 1, got {min_ngram}")
    if num_draft <= 0 or window <= 0:
        return []
    ctx = token_ids[-window:] if len(token_ids) > window else token_ids
    n_ctx = len(ctx)
    # An occurrence of an n-gram must end before the last token, so n <= n_ctx - 1.
    top = min(max_ngram, n_ctx - 1)
    if top < min_ngram:
        return []
    buf = array("i", ctx).tobytes()
    end = (n_ctx - 1) * _ITEM  # occurrences lie in buf[:end]: never the suffix itself
    for n in range(top, min_ngram - 1, -1):
        pattern = buf[-n * _ITEM :]
        stop = end
        while (at := buf.rfind(pattern, 0, stop)) >= 0:
            if at % _ITEM == 0:
                follow = at // _ITEM + n
                return list(ctx[follow : follow + num_draft])
            stop = at + len(pattern) - 1  # a match across token boundaries: look further back
    return []


@dataclass
class Verdict:
    """Result of verifying one sequence's draft.

    accepted: number of draft tokens accepted (0 .. len(draft)).
    tokens: the tokens to append: the accepted drafts + one more (the correction or the bonus
        token); always len(tokens) == accepted + 1.
    logprobs: raw-model log-probs (log_softmax of the unmodified logits) of each token in
        `tokens`, as the sampler reports them.
    """

    accepted: int
    tokens: list[int]
    logprobs: list[float]


def verify_greedy(target_argmax: Sequence[int], draft: Sequence[int]) -> int:
    """Number of leading drafts equal to the target's argmax at their position."""
    accepted = 0
    for want, got in zip(target_argmax, draft):
        if want != got:
            break
        accepted += 1
    return accepted


def verify(
    probs: torch.Tensor,
    draft: Sequence[int],
    generator: torch.Generator | None,
    greedy: bool,
) -> tuple[int, int]:
    """Verify `draft` against the target distributions; return (accepted, next_token).

    probs: [len(draft) + 1, V], row j the processed target distribution at the position of
    draft[j] (row len(draft): the position after the last draft). Rows need not be exactly
    normalised (each is treated as p_j / sum(p_j)).
    greedy: accept while draft[j] == argmax(probs[j]); next_token = argmax at the first mismatch
    or at the end. Draws nothing.
    sampling: accept draft[j] with probability probs[j, draft[j]]; on the first rejection draw the
    next token from probs[j] with draft[j] zeroed; if all are accepted draw the bonus token from
    probs[len(draft)]. Draws len(draft) uniforms, then V exponentials, from `generator` on its
    own device (as the sampler does, so the stream depends only on the request) or, when None,
    from the global RNG (uniforms on the CPU, exponentials on probs' device).
    """
    k = len(draft)
    if probs.dim() != 2 or probs.shape[0] != k + 1:
        raise ValueError(f"probs must be [len(draft) + 1 = {k + 1}, V], got {tuple(probs.shape)}")
    vocab = probs.shape[1]
    if any(not 0 <= t < vocab for t in draft):
        raise ValueError(f"draft token outside the vocabulary [0, {vocab}): {list(draft)}")
    if greedy:
        target = probs.argmax(dim=-1).tolist()
        accepted = verify_greedy(target, draft)
        return accepted, target[accepted]

    device = probs.device
    accepted = 0
    if k:
        head = probs[:k]
        d = torch.tensor(list(draft), dtype=torch.long, device=device).unsqueeze(1)
        mass = torch.cat(
            [head.gather(1, d).double(), head.sum(dim=-1, keepdim=True, dtype=torch.float64)], 1
        ).tolist()
        if generator is None:  # the uniforms are compared on the host: draw them there
            u = torch.rand(k, dtype=torch.float64).tolist()
        else:
            u = torch.rand(k, generator=generator, device=generator.device, dtype=torch.float64)
            u = u.tolist()
        # u < p / sum(p), without dividing: a draft holding all of a row's mass is always accepted.
        for u_j, (p_j, s_j) in zip(u, mass):
            if not u_j * s_j < p_j:
                break
            accepted += 1
    # Exponential race: argmax(p / q), q ~ Exp(1) i.i.d., is a draw from p / sum(p). Zero-mass
    # tokens score -1 so that no underflow can ever let one win; a rejected draft is zeroed too,
    # which leaves the residual max(p - q, 0) of a point-mass proposal q.
    if generator is not None:
        q = torch.empty(vocab, device=generator.device).exponential_(generator=generator)
        q = q.to(device)
    else:
        q = torch.empty(vocab, device=device).exponential_()
    q.clamp_min_(torch.finfo(torch.float32).tiny)
    row = probs[accepted]
    score = torch.where(row > 0, row / q, -1.0)
    if accepted < k:
        score[draft[accepted]] = -1.0
    return accepted, int(score.argmax())


def build_verdict(
    draft: Sequence[int], accepted: int, next_token: int, raw_logprobs: torch.Tensor
) -> Verdict:
    """Verdict of a verification: raw_logprobs [>= accepted + 1, V] are the raw log-probs at each
    position (`Sampler.probs`' second output), row j scoring the token emitted at position j."""
    tokens = [int(t) for t in draft[:accepted]] + [int(next_token)]
    rows = torch.arange(len(tokens), device=raw_logprobs.device)
    cols = torch.tensor(tokens, dtype=torch.long, device=raw_logprobs.device)
    return Verdict(accepted=accepted, tokens=tokens, logprobs=raw_logprobs[rows, cols].tolist())
