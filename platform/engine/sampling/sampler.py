"""Per-row vectorised token sampler.

One batch mixes rows from different requests, each with its own sampling parameters. Every
transformation is vectorised across rows (per-row parameter tensors, [B, V] masks); the only Python
loop over rows draws the noise of seeded rows, so that a seeded request never depends on its batch.

Pipeline, per step:
    logit_bias (OpenAI: added to the logits) -> token mask (structured output: disallowed tokens -inf)
    -> penalties (repetition, then frequency/presence)
    -> greedy rows: argmax of the penalised logits
    -> temperature -> top-k -> top-p -> min-p -> sample (exponential race)

`Sampler.probs` returns the distributions that pipeline samples from, without drawing (used by
speculative decoding to verify draft tokens).

Reported logprobs are those of the model's raw distribution (log_softmax of the unmodified logits),
as the OpenAI API reports them, not of the distribution actually sampled from (no logit_bias, no
grammar mask, no penalties, no temperature); so are `top_logprobs`, a row's k most likely tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from loramux.engine.sampling.params import SamplingControls

__all__ = ["SamplingRow", "SamplerOutput", "Sampler", "TokenMasker", "apply_penalties", "top_logprobs"]

# Temperatures below this are treated as greedy (dividing by them would overflow anyway).
_GREEDY_TEMPERATURE = 1e-5
# Slack on the top-p comparison: float32 softmax/cumsum rounding must not decide whether a token
# whose preceding mass is exactly top_p (e.g. 0.5 + 0.3 vs 0.8) is kept.
_TOP_P_SLACK = 1e-6


@dataclass
class SamplingRow(SamplingControls):
    """Sampling parameters of one row (one request); plain Python, built by the engine per step.

    temperature: < 1e-5 (including <= 0) means greedy (argmax of the penalised logits).
    top_k: 0 or negative = off; else keep the k highest logits.
    top_p: nucleus; keep the smallest set of top tokens whose mass >= top_p (1.0 = off).
    min_p: drop tokens whose prob < min_p * max prob (0.0 = off).
    repetition_penalty: HF/CTRL semantics over prompt and output tokens: logit > 0 -> logit / p,
        else logit * p (1.0 = off).
    presence_penalty: OpenAI semantics over output tokens: logit -= presence * (count > 0).
    frequency_penalty: OpenAI semantics over output tokens: logit -= frequency * count.
    seed: the request's seed. The sampler itself reads only the generator the engine passes for the
        row (made once per request with `Sampler.make_generator(seed)` and kept across steps).
    prompt_token_ids: only read when repetition_penalty != 1.
    output_token_ids: tokens generated so far by this request.
    logit_bias: token id -> value added to its logit before anything else (OpenAI semantics: -100
        effectively bans a token, +100 effectively forces it).
    top_logprobs: also report this row's k most likely tokens under the raw distribution (0 = off).
    """

    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    top_logprobs: int = 0


@dataclass
class SamplerOutput:
    """token_ids[i]: the token chosen for row i; logprobs[i]: its log-prob under the raw logits;
    top_logprobs[i]: row i's top_logprobs most likely (token id, raw log-prob), most likely first ([] when 0)."""

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)


def _is_greedy(row: SamplingRow) -> bool:
    return row.temperature < _GREEDY_TEMPERATURE


def _has_penalty(row: SamplingRow) -> bool:
    return (
        row.repetition_penalty != 1.0 or row.presence_penalty != 0.0 or row.frequency_penalty != 0.0
    )


def _pad(seqs: list[Sequence[int]], pad: int, device: torch.device) -> torch.Tensor:
    """[len(seqs), max_len] long tensor, right-padded with `pad`."""
    width = max((len(s) for s in seqs), default=0)
    padded = [list(s) + [pad] * (width - len(s)) for s in seqs]
    return torch.tensor(padded, dtype=torch.long, device=device).reshape(len(seqs), width)


def _penalise(x: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Penalties on float32 `x` [B, V]; may write into `x`, returns the result."""
    idx = [i for i, r in enumerate(rows) if _has_penalty(r)]
    if not idx:
        return x
    device, vocab = x.device, x.shape[1]
    sub_rows = [rows[i] for i in idx]
    whole = len(idx) == x.shape[0]
    index = torch.tensor(idx, dtype=torch.long, device=device)
    sub = x if whole else x.index_select(0, index)
    n = len(idx)

    # Token id `vocab` is the padding: it lands in an extra column that is dropped afterwards.
    out_ids = _pad([r.output_token_ids for r in sub_rows], vocab, device)
    counts = torch.zeros(n, vocab + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, out_ids, torch.ones(out_ids.shape, dtype=torch.float32, device=device))
    counts = counts[:, :vocab]

    rep = [r.repetition_penalty for r in sub_rows]
    if any(p != 1.0 for p in rep):
        # Prompts are only needed by rows that actually use the repetition penalty.
        prompts = [
            r.prompt_token_ids if p != 1.0 else () for r, p in zip(sub_rows, rep, strict=True)
        ]
        prompt_ids = _pad(prompts, vocab, device)
        seen = torch.zeros(n, vocab + 1, dtype=torch.bool, device=device)
        seen.scatter_(1, prompt_ids, True)
        seen = seen[:, :vocab] | (counts > 0)
        p = torch.tensor(rep, dtype=torch.float32, device=device).unsqueeze(1)
        # where() leaves unseen columns bit-identical; p == 1 rows are unchanged (x/1 == x*1 == x).
        sub = torch.where(seen, torch.where(sub > 0, sub / p, sub * p), sub)

    freq = [r.frequency_penalty for r in sub_rows]
    if any(f != 0.0 for f in freq):
        f = torch.tensor(freq, dtype=torch.float32, device=device).unsqueeze(1)
        sub = sub - f * counts  # count 0 subtracts exactly 0.0: other columns stay bit-identical
    pres = [r.presence_penalty for r in sub_rows]
    if any(v != 0.0 for v in pres):
        v = torch.tensor(pres, dtype=torch.float32, device=device).unsqueeze(1)
        sub = sub - v * (counts > 0).to(torch.float32)

    if whole:
        return sub
    return x.index_copy_(0, index, sub)


# Masks the logits [B, V] in place (float32, the sampler's private copy): structured output's token masks.
TokenMasker = Callable[[torch.Tensor], None]


def _bias_and_mask(raw: torch.Tensor, rows: list[SamplingRow], mask: TokenMasker | None) -> torch.Tensor:
    """`raw` with each row's logit_bias added and `mask` applied: a copy when either does anything, else
    `raw` itself (rows without either stay bit-identical)."""
    biased = [(i, r.logit_bias) for i, r in enumerate(rows) if r.logit_bias]
    if not biased and mask is None:
        return raw
    x = raw.clone()
    if biased:
        index = [(i, t) for i, bias in biased for t in bias]
        where = torch.tensor(index, dtype=torch.long, device=x.device).t()
        values = torch.tensor([b for _, bias in biased for b in bias.values()], dtype=torch.float32, device=x.device)
        x.index_put_((where[0], where[1]), values, accumulate=True)
    if mask is not None:
        mask(x)
    return x


def top_logprobs(logprobs: torch.Tensor, ks: Sequence[int]) -> list[list[tuple[int, float]]]:
    """Row i's ks[i] largest log-probs of `logprobs` [B, V] as (token id, log-prob), largest first ([] for
    ks[i] = 0): one topk over the rows that ask for any."""
    out: list[list[tuple[int, float]]] = [[] for _ in ks]
    want = [i for i, k in enumerate(ks) if k > 0]
    if not want:
        return out
    sub = logprobs if len(want) == logprobs.shape[0] else logprobs[want]
    values, ids = sub.topk(min(max(ks), logprobs.shape[1]), dim=-1)
    for i, vals, toks in zip(want, values.tolist(), ids.tolist()):
        out[i] = list(zip(toks[:ks[i]], vals[:ks[i]]))
    return out


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Return float32 logits [B, V] with each row's repetition, then frequency/presence penalties.

    Repetition (HF/CTRL) applies to every token of the row's prompt or output: positive logits
    are divided by the penalty, others multiplied. Frequency and presence (OpenAI) apply to output
    tokens only: logit -= frequency * count + presence * (count > 0). All other entries are
    bit-identical to `logits.float()`. `logits` is not modified.
    """
    return _penalise(logits.to(torch.float32, copy=True), rows)


def _top_k_top_p_(x: torch.Tensor, top_k: list[int], top_p: list[float]) -> None:
    """Mask (-inf, in place) tokens outside each row's top-k, then its nucleus, using one sort.

    Top-p is computed on the top-k-renormalised distribution. The top token always survives.
    """
    n, vocab = x.shape
    device = x.device
    sorted_x, order = x.sort(dim=-1, descending=True)
    drop = torch.zeros(n, vocab, dtype=torch.bool, device=device)
    if any(0 < k < vocab for k in top_k):
        k = torch.tensor([k if 0 < k < vocab else vocab for k in top_k], device=device)
        drop |= torch.arange(vocab, device=device).unsqueeze(0) >= k.unsqueeze(1)
    if any(p < 1.0 for p in top_p):
        probs = sorted_x.masked_fill(drop, float("-inf")).softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        # Rows with top_p >= 1 get an infinite threshold so rounding in the cumsum never trims them.
        limit = torch.tensor(
            [p - _TOP_P_SLACK if p < 1.0 else float("inf") for p in top_p],
            dtype=torch.float32,
            device=device,
        )
        drop |= mass_before >= limit.unsqueeze(1)
    drop[:, 0] = False
    x.masked_fill_(torch.zeros_like(drop).scatter_(1, order, drop), float("-inf"))


def _min_p_(x: torch.Tensor, min_p: list[float]) -> None:
    """Mask (-inf, in place) tokens whose prob < min_p * max prob. The top token always survives."""
    probs = x.softmax(dim=-1)
    # Clamping at 1 keeps the max-prob token even for min_p > 1.
    scale = torch.tensor(min_p, dtype=torch.float32, device=x.device).clamp(max=1.0).unsqueeze(1)
    x.masked_fill_(probs < probs.amax(dim=-1, keepdim=True) * scale, float("-inf"))


class Sampler:
    """Choose one token per row of a [B, V] logits batch, each row with its own SamplingRow."""

    def __init__(self) -> None:
        pass

    @staticmethod
    def make_generator(seed: int) -> torch.Generator:
        """A CPU generator seeded with `seed`; the engine keeps one per seeded request."""
        gen = torch.Generator(device="cpu")
        gen.manual_seed(seed)
        return gen

    def __call__(
        self,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        generators: list[torch.Generator | None],
        mask: TokenMasker | None = None,
    ) -> SamplerOutput:
        """Sample one token per row.

        logits: [B, V] float32 or bfloat16 (computed in float32); rows[i] and generators[i]
        belong to row i. `mask` (structured output) sets disallowed tokens to -inf after logit_bias;
        `logits` itself is never written to. A sampled row with generators[i] set draws its noise
        only from that generator, so a seeded request yields the same tokens wherever it sits and
        whatever shares its batch; unseeded rows share one draw from the default generator. Greedy
        rows draw nothing.
        """
        n_rows, vocab = logits.shape
        if n_rows == 0:
            return SamplerOutput(token_ids=[], logprobs=[])
        device = logits.device
        raw = logits.float()  # aliases `logits` when already float32; never written to
        x = _bias_and_mask(raw, rows, mask)

        greedy = [_is_greedy(r) for r in rows]
        penalised = any(_has_penalty(r) for r in rows)
        if all(greedy) and not penalised:
            return self._output(raw, x.argmax(dim=-1), rows)

        if penalised:
            x = _penalise(x.clone() if x is raw else x, rows)
        tokens = torch.empty(n_rows, dtype=torch.long, device=device)

        greedy_idx = [i for i, g in enumerate(greedy) if g]
        if greedy_idx:
            gi = torch.tensor(greedy_idx, dtype=torch.long, device=device)
            tokens[gi] = x.index_select(0, gi).argmax(dim=-1)

        sample_idx = [i for i, g in enumerate(greedy) if not g]
        if sample_idx:
            si = torch.tensor(sample_idx, dtype=torch.long, device=device)
            tokens[si] = self._sample(x, [rows[i] for i in sample_idx], sample_idx, si, generators)

        return self._output(raw, tokens, rows)

    def probs(
        self, logits: torch.Tensor, rows: list[SamplingRow], mask: TokenMasker | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-row distributions that `__call__` samples from, and the raw log-probs.

        Returns (probs, raw_logprobs), both float32 [B, V]. probs[i] is row i's processed
        distribution (logit_bias, `mask`, penalties, temperature, top-k, top-p, min-p; zeros where
        filtered); a greedy row gets a one-hot at the argmax of its biased, masked, penalised logits,
        i.e. the token `__call__` picks.
        raw_logprobs is log_softmax of the unmodified logits, the distribution logprobs are
        reported from. Draws nothing from any generator. Speculative decoding calls it with one row
        per verified position.
        """
        n_rows, vocab = logits.shape
        device = logits.device
        raw = logits.float()
        raw_logprobs = torch.log_softmax(raw, dim=-1)
        if n_rows == 0:
            return torch.empty(0, vocab, dtype=torch.float32, device=device), raw_logprobs

        greedy = [_is_greedy(r) for r in rows]
        penalised = any(_has_penalty(r) for r in rows)
        x = _bias_and_mask(raw, rows, mask)
        if penalised:
            x = _penalise(x.clone() if x is raw else x, rows)
        out = torch.zeros(n_rows, vocab, dtype=torch.float32, device=device)

        greedy_idx = [i for i, g in enumerate(greedy) if g]
        if greedy_idx:
            gi = torch.tensor(greedy_idx, dtype=torch.long, device=device)
            out[gi, x.index_select(0, gi).argmax(dim=-1)] = 1.0

        sample_idx = [i for i, g in enumerate(greedy) if not g]
        if sample_idx:
            si = torch.tensor(sample_idx, dtype=torch.long, device=device)
            out[si] = self._filtered_probs(x, [rows[i] for i in sample_idx], si)
        return out, raw_logprobs

    @staticmethod
    def _sample(
        x: torch.Tensor,
        rows: list[SamplingRow],
        sample_idx: list[int],
        si: torch.Tensor,
        generators: list[torch.Generator | None],
    ) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p and the exponential race for the non-greedy rows."""
        probs = Sampler._filtered_probs(x, rows, si)
        return Sampler._race(probs, sample_idx, generators)

    @staticmethod
    def _filtered_probs(
        x: torch.Tensor, rows: list[SamplingRow], si: torch.Tensor
    ) -> torch.Tensor:
        """Softmax of x[si] after temperature, top-k, top-p, min-p (rows[j]: row si[j])."""
        device, vocab = x.device, x.shape[1]
        temps = torch.tensor([r.temperature for r in rows], dtype=torch.float32, device=device)
        xs = x.index_select(0, si) / temps.unsqueeze(1)  # a fresh tensor: safe to mask in place

        # Truncations touch only the rows that use them (subset, mask, write back).
        trunc = [j for j, r in enumerate(rows) if 0 < r.top_k < vocab or r.top_p < 1.0]
        if trunc:
            t = torch.tensor(trunc, dtype=torch.long, device=device)
            sub = xs.index_select(0, t)
            _top_k_top_p_(sub, [rows[j].top_k for j in trunc], [rows[j].top_p for j in trunc])
            xs.index_copy_(0, t, sub)
        min_p = [j for j, r in enumerate(rows) if r.min_p > 0.0]
        if min_p:
            t = torch.tensor(min_p, dtype=torch.long, device=device)
            sub = xs.index_select(0, t)
            _min_p_(sub, [rows[j].min_p for j in min_p])
            xs.index_copy_(0, t, sub)

        return xs.softmax(dim=-1)

    @staticmethod
    def _race(
        probs: torch.Tensor, sample_idx: list[int], generators: list[torch.Generator | None]
    ) -> torch.Tensor:
        """One draw per row of `probs` (row j belongs to batch row sample_idx[j]), by inverting the CDF with
        one uniform per row: exact, and one random number per row instead of one per vocabulary entry (an
        exponential race over a 49k vocabulary cost ~1 ms per row on CPU). A seeded row takes its uniform
        from its own generator, so its stream depends only on the request, never on the batch."""
        device, vocab = probs.device, probs.shape[1]
        u = torch.empty(len(sample_idx), dtype=torch.float64, device=device)
        unseeded = [j for j, i in enumerate(sample_idx) if generators[i] is None]
        if unseeded:
            u[unseeded] = torch.rand(len(unseeded), dtype=torch.float64, device=device)
        for j, i in enumerate(sample_idx):
            gen = generators[i]
            if gen is not None:  # drawn on the generator's own device
                u[j] = torch.rand(1, dtype=torch.float64, generator=gen, device=gen.device).item()
        cdf = probs.to(torch.float64).cumsum_(dim=-1)
        # side="right": the first index whose cumulative mass exceeds u * total, so a zero-probability token
        # (whose cdf equals its predecessor's) is never chosen.
        tokens = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
        overflow = tokens >= vocab  # u * total rounded up to total: take the row's last token with mass
        if bool(overflow.any()):
            last = vocab - 1 - (probs.flip(-1) > 0).to(torch.int8).argmax(dim=-1)
            tokens = torch.where(overflow, last, tokens)
        return tokens

    @staticmethod
    def _output(raw: torch.Tensor, tokens: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        # log_softmax at one index: logit - logsumexp, without a [B, V] log_softmax tensor.
        chosen = raw.gather(1, tokens.unsqueeze(1)).squeeze(1)
        logprobs = chosen - torch.logsumexp(raw, dim=-1)
        ks = [r.top_logprobs for r in rows]
        tops = [[] for _ in rows]
        if any(ks):
            want = [i for i, k in enumerate(ks) if k > 0]
            picked = top_logprobs(torch.log_softmax(raw[want], dim=-1), [ks[i] for i in want])
            for i, top in zip(want, picked):
                tops[i] = top
        return SamplerOutput(token_ids=tokens.tolist(), logprobs=logprobs.tolist(), top_logprobs=tops)
