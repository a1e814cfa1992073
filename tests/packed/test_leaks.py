"""The parity check must fail when isolation is broken: each leak below is a real bug we could write."""

import pytest
import torch
from parity import compare, without_float32_casts
from tiny_models import patched_lora_model, random_pack

from packtrain.packed import attention, gdn, layout
from packtrain.packed.kernels import Backend

L, F = "linear_attention", "full_attention"
SPECS = [(3, 2), (70, 4), (10, 3)]


def _diff(monkeypatch, attention_impl="batched"):
    with without_float32_casts(monkeypatch):
        model = patched_lora_model([L, F, L], seed=2, backend=Backend(gdn="torch", attention=attention_impl))
        prefix, conts = random_pack(65, SPECS, seed=5)
        return compare(model, prefix, conts)


def test_clean_pack_passes(monkeypatch):
    d = _diff(monkeypatch)
    assert d.loss < 1e-13 and d.grad < 5e-7


def test_conv_tail_from_wrong_segment_is_caught(monkeypatch):
    # each continuation gets the previous continuation's last conv inputs instead of P's
    def leaky_conv(mixed_TC, weight_CW, bias_C, lay):
        p, W = lay.prefix_len, weight_CW.shape[-1]
        out_P = gdn.torch_ref.causal_conv_silu(mixed_TC[:p].T[None], weight_CW, bias_C)[0].T
        out_C = gdn.torch_ref.causal_conv_silu(mixed_TC[p - (W - 1):].T[None], weight_CW, bias_C)[0].T[W - 1:]
        return torch.cat([out_P, out_C])

    monkeypatch.setattr(gdn, "packed_conv_torch", leaky_conv)
    d = _diff(monkeypatch)
    assert d.loss > 1e-6 and d.grad > 1e-3, d


def test_state_chained_through_previous_continuation_is_caught(monkeypatch):
    # the naive packing bug: run the whole buffer as one sequence, continuation i starts from i-1's state
    def leaky_rule(q, k, v, g, beta, lay):
        out, _ = gdn.torch_ref.chunk_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None])
        return out[0]

    monkeypatch.setattr(gdn, "packed_delta_rule_torch", leaky_rule)
    d = _diff(monkeypatch)
    assert d.loss > 1e-6 and d.grad > 1e-3, d


def test_detached_prefix_state_is_caught_by_gradients_only(monkeypatch):
    # the continuations' gradient never reaches P through the state: losses stay exact, gradients do not
    original = gdn.torch_ref.chunk_gated_delta_rule

    def detaching(*args, initial_state=None, **kwargs):
        return original(*args, initial_state=None if initial_state is None else initial_state.detach(), **kwargs)

    monkeypatch.setattr(gdn.torch_ref, "chunk_gated_delta_rule", detaching)
    d = _diff(monkeypatch)
    assert d.loss < 1e-13, "a detached state does not change the forward"
    assert d.grad > 1e-3, d


def test_attention_seeing_other_continuations_is_caught(monkeypatch):
    def causal_only(seg_q, seg_kv, q_idx, kv_idx):
        return kv_idx <= q_idx

    monkeypatch.setattr(layout, "shared_prefix_allowed", causal_only)
    d = _diff(monkeypatch, attention_impl="dense")
    assert d.loss > 1e-6 and d.grad > 1e-3, d


@pytest.mark.parametrize("bad_positions", ["cumulative"])
def test_buffer_positions_instead_of_standalone_are_caught(monkeypatch, bad_positions):
    original = layout._finish

    def cumulative(p, lens, ids, positions, *rest):
        return original(p, lens, ids, [list(range(len(ids)))] * 3, *rest)

    monkeypatch.setattr(layout, "_finish", cumulative)
    d = _diff(monkeypatch)
    assert d.loss > 1e-6 and d.grad > 1e-3, d
