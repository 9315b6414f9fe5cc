"""kernels/gated_delta.py against transformers' torch fallbacks (the reference the issue names): the chunked and
the recurrent gated delta rule from a given state, over lengths that are not multiples of the chunk, with grouped
value heads; and the causal convolution continued across calls equal to one call over the whole sequence."""
from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from loramux.kernels.gated_delta import (
    causal_conv1d,
    chunk_gated_delta_rule,
    gated_delta_step,
    recurrent_gated_delta_rule,
)


def inputs(batch: int, steps: int, key_heads: int = 2, value_heads: int = 4, dim: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, steps, key_heads, dim, generator=g)
    k = torch.randn(batch, steps, key_heads, dim, generator=g)
    v = torch.randn(batch, steps, value_heads, dim, generator=g)
    decay = -torch.rand(batch, steps, value_heads, generator=g) * 2
    beta = torch.rand(batch, steps, value_heads, generator=g)
    state = torch.randn(batch, value_heads, dim, dim, generator=g)
    return q, k, v, decay, beta, state


@pytest.mark.parametrize("steps", [1, 37, 64, 130])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_rule_equals_transformers(steps, with_state):
    q, k, v, g, beta, state = inputs(2, steps)
    initial = state if with_state else None
    want, want_state = hf.torch_chunk_gated_delta_rule(q, k, v, g, beta, initial_state=initial,
                                                       output_final_state=True, use_qk_l2norm_in_kernel=True)
    got, got_state = chunk_gated_delta_rule(q, k, v, g, beta, initial)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(got_state, want_state, rtol=0, atol=0)


@pytest.mark.parametrize("steps", [1, 5])
def test_recurrent_rule_equals_transformers(steps):
    q, k, v, g, beta, state = inputs(3, steps, seed=1)
    want, want_state = hf.torch_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=state,
                                                           output_final_state=True, use_qk_l2norm_in_kernel=True)
    got, got_state = recurrent_gated_delta_rule(q, k, v, g, beta, state)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(got_state, want_state, rtol=0, atol=0)


def test_chunked_and_recurrent_rules_agree_and_chain():
    """Two chunks carried through the state equal one pass, and equal the token-by-token rule."""
    q, k, v, g, beta, _ = inputs(1, 90, seed=2)
    whole, whole_state = chunk_gated_delta_rule(q, k, v, g, beta, None)
    first, state = chunk_gated_delta_rule(q[:, :50], k[:, :50], v[:, :50], g[:, :50], beta[:, :50], None)
    second, state = chunk_gated_delta_rule(q[:, 50:], k[:, 50:], v[:, 50:], g[:, 50:], beta[:, 50:], state)
    torch.testing.assert_close(torch.cat((first, second), dim=1), whole, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(state, whole_state, rtol=1e-4, atol=1e-5)
    token_by_token, stepped = recurrent_gated_delta_rule(q, k, v, g, beta, None)
    torch.testing.assert_close(token_by_token, whole, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(stepped, whole_state, rtol=1e-4, atol=1e-5)


def test_causal_conv_continues_across_calls():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 6, 11, generator=g)
    weight = torch.randn(6, 4, generator=g)
    want = hf.causal_conv1d_fn(x, weight, None, activation="silu")
    first, window = causal_conv1d(x[:, :, :7], None, weight)
    second, window = causal_conv1d(x[:, :, 7:], window, weight)
    torch.testing.assert_close(torch.cat((first, second), dim=-1), want, rtol=0, atol=1e-6)
    assert torch.equal(window, x[:, :, -3:])
    # one decode token from the window, as transformers' causal_conv1d_update computes it
    token = torch.randn(2, 6, 1, generator=g)
    hf_window = window.clone()
    want_step = hf.causal_conv1d_update(token, hf_window, weight, None, activation="silu")
    got_step, new_window = causal_conv1d(token, window, weight)
    torch.testing.assert_close(got_step, want_step, rtol=0, atol=0)
    assert torch.equal(new_window, hf_window)


def test_decode_step_equals_the_recurrent_rule_and_updates_in_place():
    q, k, v, g, beta, state = inputs(3, 1, seed=4)
    want, want_state = recurrent_gated_delta_rule(q, k, v, g, beta, state)
    inplace = state.clone()
    got = gated_delta_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], inplace)
    torch.testing.assert_close(got, want[:, 0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(inplace, want_state, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("slots, span, order", [
    ([5, 3, 4], 3, [1, 2, 0]),  # one range of slots, rows in another order: read in place, in slot order
    ([0, 2], None, None),  # a gap: gathered copies
    ([], None, None),
])
def test_state_batch_reads_a_range_of_slots_in_place(slots, span, order):
    from loramux.model.linear_attention import StateBatch

    batch = StateBatch.build([], 7, slots, lambda xs: torch.tensor(xs, dtype=torch.long))
    assert batch.decode_span == span
    assert (batch.decode_order.tolist() if batch.decode_order is not None else None) == order
    assert (batch.decode_slots.tolist() if batch.decode_slots is not None else []) == slots
