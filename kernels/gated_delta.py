"""The gated delta rule of Gated DeltaNet layers (Qwen3.5, Qwen3-Next) and their causal convolution, in torch.

Per value head, with a state S [key_dim, value_dim] and per token a decay g <= 0 (log space) and a rate beta:

    S = exp(g) * S;   S = S + k (beta * (v - k^T S))^T;   o = q^T S

where q and k are L2-normalised and q is scaled by key_dim ** -0.5. `recurrent_gated_delta_rule` runs it token by
token (decode); `chunk_gated_delta_rule` runs it over chunks of 64 tokens with a triangular solve inside each
chunk (prefill). Both follow transformers' torch fallbacks (`torch_recurrent_gated_delta_rule`,
`torch_chunk_gated_delta_rule`) operation for operation, in float32, so that HF is the reference they are tested
against; the state stays float32 as HF keeps it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def _heads_first(q, k, v, g, beta):
    """[B, T, heads, D] inputs -> float32 [B, value heads, T, D], q/k repeated over grouped value heads, normed."""
    key_heads, value_heads = k.shape[2], v.shape[2]
    if key_heads != value_heads:  # each q/k head serves value_heads // key_heads consecutive value heads
        q = q.repeat_interleave(value_heads // key_heads, dim=2)
        k = k.repeat_interleave(value_heads // key_heads, dim=2)
    q, k, v, g, beta = (x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
                        for x in (q, k, v, g, beta))
    q, k = _l2norm(q), _l2norm(k)
    return q, k, v, g, beta


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                               state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [B, T, key heads, Dk], v [B, T, value heads, Dv], g, beta [B, T, value heads], `state` float32
    [B, value heads, Dk, Dv] (None: zeros) -> (output [B, T, value heads, Dv] in v's dtype, final state float32)."""
    dtype = v.dtype
    q, k, v, g, beta = _heads_first(q, k, v, g, beta)
    q = q / (q.shape[-1] ** 0.5)
    batch, heads, steps, _ = v.shape
    s = torch.zeros(batch, heads, k.shape[-1], v.shape[-1], dtype=torch.float32, device=v.device) \
        if state is None else state.to(torch.float32)
    out = torch.zeros_like(v)
    for t in range(steps):
        s = s * g[:, :, t].exp()[..., None, None]
        kv_mem = (s * k[:, :, t].unsqueeze(-1)).sum(dim=-2)
        delta = (v[:, :, t] - kv_mem) * beta[:, :, t].unsqueeze(-1)
        s = s + k[:, :, t].unsqueeze(-1) * delta.unsqueeze(-2)
        out[:, :, t] = (s * q[:, :, t].unsqueeze(-1)).sum(dim=-2)
    return out.transpose(1, 2).contiguous().to(dtype), s


def gated_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor) -> torch.Tensor:
    """One token of the rule per sequence, the decode step: q, k [B, key heads, Dk], v [B, value heads, Dv], g, beta
    [B, value heads], `state` float32 [B, value heads, Dk, Dv] updated in place -> output [B, value heads, Dv] in
    v's dtype. The same maths as `recurrent_gated_delta_rule` for T = 1, arranged to pass over the state three
    times instead of about ten (it dominates a decode step's memory traffic): with d = exp(g),
    k^T (d S) = d (k^T S) and q^T S' = d (q^T S) + (q . k) delta, so k^T S and q^T S come from one batched matmul
    before S is updated in place; sums run in another order than the reference's, equal to float32 rounding."""
    dtype = v.dtype
    group = v.shape[1] // k.shape[1]
    if group > 1:
        q, k = q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1)
    q, k = _l2norm(q.float()), _l2norm(k.float())
    q = q / (q.shape[-1] ** 0.5)
    decay = g.float().exp().unsqueeze(-1)  # [B, H, 1]
    read = torch.stack((k, q), dim=2) @ state  # [B, H, 2, Dv]: k^T S and q^T S
    delta = (v.float() - read[:, :, 0] * decay) * beta.float().unsqueeze(-1)
    batch, heads, key_dim, value_dim = state.shape
    state.mul_(decay.unsqueeze(-1))
    state.view(batch * heads, key_dim, value_dim).baddbmm_(k.reshape(-1, key_dim, 1), delta.reshape(-1, 1, value_dim))
    out = read[:, :, 1] * decay + (q * k).sum(-1, keepdim=True) * delta
    return out.to(dtype)


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """As `recurrent_gated_delta_rule`, computed 64 tokens at a time: within a chunk the delta-rule updates are one
    unit-lower-triangular solve (the UT transform), and the state is carried from chunk to chunk."""
    dtype = v.dtype
    q, k, v, g, beta = _heads_first(q, k, v, g, beta)
    q = q * q.shape[-1] ** -0.5
    batch, heads, steps, value_dim = v.shape
    pad = (CHUNK - steps % CHUNK) % CHUNK
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    v_beta, k_beta = v * beta.unsqueeze(-1), k * beta.unsqueeze(-1)
    q, k, k_beta, v_beta = (x.reshape(batch, heads, -1, CHUNK, x.shape[-1]) for x in (q, k, k_beta, v_beta))
    g = g.reshape(batch, heads, -1, CHUNK)
    upper = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)
    cum = g.cumsum(dim=3)  # log of the decay from the chunk's start to each position
    pair_decay = (cum.unsqueeze(4) - cum.unsqueeze(3)).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * pair_decay
    intra = (q @ k.transpose(-1, -2)) * pair_decay
    decayed_k_beta = k_beta * cum.exp().unsqueeze(-1)
    new_values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(system, decayed_k_beta, upper=False, unitriangular=True)
    s = torch.zeros(batch, heads, k.shape[-1], value_dim, dtype=torch.float32, device=v.device) \
        if state is None else state.to(new_values)
    out = torch.zeros_like(new_values)
    q = q * cum.exp().unsqueeze(-1)
    k = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]
    for i in range(q.shape[2]):
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ s
        out[:, :, i] = q[:, :, i] @ s + intra[:, :, i] @ v_new
        s = s * chunk_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_new
    out = out.reshape(batch, heads, -1, value_dim)[:, :, :steps]
    return out.transpose(1, 2).to(dtype, memory_format=torch.contiguous_format), s


def causal_conv1d(x: torch.Tensor, window: torch.Tensor | None, weight: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution with SiLU of x [B, C, T] continuing from `window` [B, C, K - 1] (the inputs
    before x; None: zeros), weight [C, K] -> (output [B, C, T] in x's dtype, the new window [B, C, K - 1])."""
    width = weight.shape[1] - 1
    if window is None:
        window = x.new_zeros(x.shape[0], x.shape[1], width)
    full = torch.cat((window.to(x.dtype), x), dim=-1)
    out = F.conv1d(full.to(weight.dtype), weight.unsqueeze(1), groups=x.shape[1])
    return F.silu(out).to(x.dtype), full[:, :, -width:]
