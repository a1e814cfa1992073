"""Decoding rows (packtrain/packed/rows.py): one new token per row through a full-attention layer (P's keys shared,
the row's own after them, one softmax) against a float64 softmax written out per row and head; through a Gated
DeltaNet layer, token by token from a zero state, against transformers' own forward of the layer on the whole
sequence; the rows' positions, advance and selection."""

import torch
from tiny_models import patched_lora_model

from packtrain.packed.kernels import Backend
from packtrain.packed.prefix import PrefixState
from packtrain.packed.rows import Rows, attend, gdn_step


def _rows(lengths, **parts) -> Rows:
    n = torch.tensor(lengths)
    return Rows(PrefixState(parts.pop("kv_P", {})), parts.pop("kv", {}), parts.pop("gdn", {}), n, n + 10, n + 7)


def test_a_new_token_attends_to_p_its_own_earlier_tokens_and_itself():
    """Two rows with 1 and 3 own tokens before the new one, query heads 2g and 2g+1 reading key head g; the buffers
    hold a huge value past each row's tokens, which no query may see."""
    g = torch.Generator().manual_seed(0)
    B, G, H, D, P, room = 2, 2, 4, 8, 3, 6
    k_P, v_P = torch.randn(1, G, P, D, generator=g, dtype=torch.float64), torch.randn(1, G, P, D, generator=g,
                                                                                      dtype=torch.float64)
    keys, values = torch.full((B, G, room, D), 1e3, dtype=torch.float64), torch.full((B, G, room, D), 1e3,
                                                                                     dtype=torch.float64)
    lengths = [1, 3]
    for b, n in enumerate(lengths):
        keys[b, :, :n], values[b, :, :n] = torch.randn(2, G, n, D, generator=g, dtype=torch.float64)
    own = (keys.clone(), values.clone())
    q = torch.randn(B, H, 1, D, generator=g, dtype=torch.float64)
    k, v = torch.randn(B, G, 1, D, generator=g, dtype=torch.float64), torch.randn(B, G, 1, D, generator=g,
                                                                                  dtype=torch.float64)
    rows = _rows(lengths, kv_P={5: (k_P, v_P)}, kv={5: (keys, values)})
    out = attend(rows, 5, q, k, v, scaling=0.3)
    for b, n in enumerate(lengths):
        assert torch.equal(keys[b, :, n], k[b, :, 0]) and torch.equal(values[b, :, n], v[b, :, 0])
        for h in range(H):
            kk = torch.cat([k_P[0, h // 2], own[0][b, h // 2, :n], k[b, h // 2]])
            vv = torch.cat([v_P[0, h // 2], own[1][b, h // 2, :n], v[b, h // 2]])
            expected = torch.softmax(kk @ q[b, h, 0] * 0.3, 0) @ vv
            torch.testing.assert_close(out[b, h, 0], expected, rtol=1e-12, atol=0)


def test_gdn_steps_from_a_zero_state_equal_the_layer_on_the_whole_sequence():
    """Two rows of six tokens each, one step per token from a zero conv tail and state: every step's output is the
    layer's own (transformers') forward of that row's whole sequence at that position."""
    model = patched_lora_model(["linear_attention"], seed=2, backend=Backend("torch", "batched"))
    layer = model.base_model.model.model.layers[0].linear_attn
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 6, model.config.hidden_size, generator=g, dtype=torch.float64)
    with torch.no_grad():
        whole = torch.cat([layer(x[b:b + 1]) for b in range(2)])
        C = layer.conv1d.weight.shape[0]
        state = torch.zeros(2, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim, dtype=torch.float64)
        rows = _rows([0, 0], gdn={0: (torch.zeros(2, C, layer.conv_kernel_size - 1, dtype=torch.float64), state)})
        steps = torch.cat([gdn_step(layer, x[:, t:t + 1], rows) for t in range(6)], dim=1)
    # transformers' GDN computes in float32 inside a float64 model
    assert (steps - whole).abs().max() < 1e-5 * whole.abs().max()


def test_positions_advance_and_selection():
    tail, state = torch.arange(3.0)[:, None, None].expand(3, 2, 3), torch.arange(3.0)[:, None, None, None]
    keys = torch.arange(3.0)[:, None, None, None].expand(3, 1, 4, 2)
    rows = _rows([2, 0, 5], kv={1: (keys, -keys)}, gdn={0: (tail, state)})
    assert rows.position_ids(mrope=False).tolist() == [[12], [10], [15]]
    assert rows.position_ids(mrope=True)[:, :, 0].tolist() == [[12, 10, 15], [9, 7, 12], [9, 7, 12], [9, 7, 12]]
    rows.advance()
    assert (rows.lengths.tolist(), rows.text.tolist(), rows.mrope.tolist()) == ([3, 1, 6], [13, 11, 16], [10, 8, 13])
    kept = rows.select(torch.tensor([2, 0]))
    assert kept.size == 2 and kept.lengths.tolist() == [6, 3] and kept.text.tolist() == [16, 13]
    assert kept.mrope.tolist() == [13, 10] and kept.prefix is rows.prefix
    assert kept.kv[1][0][:, 0, 0, 0].tolist() == [2.0, 0.0] and kept.kv[1][1][:, 0, 0, 0].tolist() == [-2.0, 0.0]
    assert kept.gdn[0][0][:, 0, 0].tolist() == [2.0, 0.0] and kept.gdn[0][1].flatten().tolist() == [2.0, 0.0]
