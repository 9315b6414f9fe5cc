"""Rotary position embeddings (HF `rotate_half` layout): linear, llama3, YaRN and LongRoPE frequency scaling, and
partial rotary (only the first `rotary_dim` dims of a head rotate, as in Phi-4-mini)."""
from __future__ import annotations

import math
from typing import Any

import torch


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] in float32, as HF computes them for the given scaling."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv_freq
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
        high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling.get("original_max_position_embeddings", 8192))
        low_freq_wavelen = old_len / low_freq_factor
        high_freq_wavelen = old_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are divided by `factor`, short ones kept, the band between interpolated smoothly.
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    if kind == "longrope":
        return longrope_inv_freq(head_dim, theta, scaling, long=False)
    if kind == "yarn":
        return yarn_inv_freq(head_dim, theta, scaling)
    raise ValueError(f"unsupported rope scaling {kind!r}")


def yarn_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN (gpt-oss): interpolated frequencies (divided by `factor`) for long wavelengths, the original ones for
    short wavelengths, and a linear ramp between the correction dims of beta_fast and beta_slow rotations, as
    transformers' `_compute_yarn_parameters`."""
    factor = float(scaling["factor"])
    original = float(scaling["original_max_position_embeddings"])
    beta_fast, beta_slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def yarn_attention_factor(scaling: dict[str, Any]) -> float:
    """YaRN's cos/sin multiplier: given, or 0.1 ln(factor) + 1 (with mscale / mscale_all_dim when both are set)."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return mscale(factor, float(scaling["mscale"])) / mscale(factor, float(scaling["mscale_all_dim"]))
    return mscale(factor)


def longrope_inv_freq(rotary_dim: int, theta: float, scaling: dict[str, Any], long: bool) -> torch.Tensor:
    """LongRoPE (Phi-3): the base frequencies divided per dimension by the short or the long factors."""
    factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    return 1.0 / (factors * theta ** exponents)


def longrope_attention_factor(scaling: dict[str, Any]) -> float:
    """The cos/sin multiplier of LongRoPE: given, or sqrt(1 + ln(s) / ln(original)) for s = max / original."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = float(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor") or float(scaling["max_position_embeddings"]) / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


class RotaryEmbedding(torch.nn.Module):
    """RoPE tables; `cos_sin(positions)` once per step, then `apply_rope` in every layer that uses them.

    LongRoPE keeps two tables and picks one per row: the long factors when the row's `rope_lens` (the sequence
    length HF would see in that forward) exceeds the original context, as HF's `longrope_frequency_update`.
    A sequence that grows past it is recomputed with the long factors (the scheduler's `long_rope_after`)."""

    cos: torch.Tensor  # [max_positions, rotary_dim / 2] buffers (registered in __init__)
    sin: torch.Tensor

    def __init__(self, rotary_dim: int, theta: float, scaling: dict[str, Any] | None, max_positions: int):
        super().__init__()
        self.rotary_dim = rotary_dim
        self.long_after: int | None = None
        positions = torch.arange(max_positions, dtype=torch.float32)
        inv_freq = rope_inv_freq(rotary_dim, theta, scaling)
        factor = 1.0
        if scaling and scaling["rope_type"] == "yarn":
            factor = yarn_attention_factor(scaling)
        if scaling and scaling["rope_type"] == "longrope":
            factor = longrope_attention_factor(scaling)
            self.long_after = int(scaling["original_max_position_embeddings"])
            long = torch.outer(positions, longrope_inv_freq(rotary_dim, theta, scaling, long=True))
            self.register_buffer("cos_long", long.cos() * factor, persistent=False)
            self.register_buffer("sin_long", long.sin() * factor, persistent=False)
        freqs = torch.outer(positions, inv_freq)
        # Precomputed table: a decode step only gathers rows instead of computing sin/cos.
        self.register_buffer("cos", freqs.cos() * factor, persistent=False)
        self.register_buffer("sin", freqs.sin() * factor, persistent=False)

    def cos_sin(self, positions: torch.Tensor, rope_lens: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows [T, 1, rotary_dim/2] for absolute positions [T] (`rope_lens` [T]: see the class)."""
        cos, sin = self.cos.index_select(0, positions), self.sin.index_select(0, positions)
        if self.long_after is not None:
            lens = positions + 1 if rope_lens is None else rope_lens
            use_long = (lens > self.long_after).unsqueeze(1)
            cos = torch.where(use_long, self.cos_long.index_select(0, positions), cos)
            sin = torch.where(use_long, self.sin_long.index_select(0, positions), sin)
        return cos.unsqueeze(1), sin.unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate heads x [T, heads, D] (HF `rotate_half` layout) by the angles of their rows; with tables of
    fewer than D/2 columns only the first 2 x columns rotate (partial rotary) and the rest pass unchanged."""
    rotary = 2 * cos.shape[-1]
    if rotary < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :rotary], cos, sin), x[..., rotary:]), dim=-1)
    # Same arithmetic as HF (x*cos + rotate_half(x)*sin with cos/sin duplicated over both halves),
    # computed in float32 so results match the reference.
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out if out.dtype == x.dtype else out.to(x.dtype)
