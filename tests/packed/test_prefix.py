"""P's state (packtrain/packed/prefix.py): what a continuation reads of P (a conv tail cut to the conv's width), a
sequence run in spans through transformers' own forward against the state before each span (StateCache) equal to
the sequence run whole, and the chain rule in two parts (leaves, then one backward through P's graph) equal to one
backward through the whole graph."""

import torch
from tiny_models import patched_lora_model

from packtrain.packed.kernels import Backend
from packtrain.packed.layout import Continuation, build_standalone_layout
from packtrain.packed.lm import PackedLM
from packtrain.packed.prefix import PrefixState, StateCache, backward_through, run_span

L, F = "linear_attention", "full_attention"


def test_conv_and_state_reads_the_last_width_minus_one_inputs_as_rows():
    tail = torch.arange(2 * 5, dtype=torch.float64).reshape(1, 2, 5)  # [1, C, 5] channels 0..4 and 5..9
    state = torch.randn(1, 2, 3, 3)
    rows, same = PrefixState(gdn={3: (tail, state)}).conv_and_state(3, width=4)
    assert rows.tolist() == [[2.0, 7.0], [3.0, 8.0], [4.0, 9.0]] and same is state


def test_the_conv_tail_recorded_is_zero_where_the_sequence_is_shorter_than_the_conv():
    """Two inputs, then three more, through a cache of conv width 4: the first span's tail is [0, x0, x1] (the conv
    pads with zeros), the second's its last three inputs; each update returns the history before the span and
    the span, as the conv reads them."""
    x = torch.arange(1.0, 6.0).reshape(1, 1, 5)
    first = StateCache(None, PrefixState())
    assert torch.equal(first.update_conv_state(x[..., :2], 0, conv_kernel_size=4), x[..., :2])
    assert first.tail_out[0].tolist() == [[[0.0, 1.0, 2.0]]]
    second = StateCache(None, PrefixState(gdn={0: (first.tail_out[0], torch.zeros(1))}))
    assert second.update_conv_state(x[..., 2:], 0, conv_kernel_size=4).tolist() == [[[0.0, 1.0, 2.0, 3.0, 4.0,
                                                                                      5.0]]]
    assert second.tail_out[0].tolist() == [[[3.0, 4.0, 5.0]]]


def test_a_sequence_in_spans_equals_it_whole():
    """Spans [0, 2), [2, 6), [6, 9) (the first shorter than the conv tail), each from the state the one before
    recorded: the hidden states equal the model's own forward on the whole sequence, and the state after the last
    span is the whole sequence's (keys and values of every position, the final conv tail and GDN state)."""
    model = patched_lora_model([L, F], seed=3, backend=Backend("torch", "batched"))
    lm = PackedLM(model)
    layout = build_standalone_layout([5, 9, 14], Continuation([20, 21, 22, 23], [30, 31]))
    with torch.no_grad():
        whole = lm.run_body(layout).last_hidden_state
        _, state_whole = run_span(lm, layout, 0, 9, PrefixState())
        hidden, states, before = [], [], PrefixState()
        for start, end in ((0, 2), (2, 6), (6, 9)):
            h, own = run_span(lm, layout, start, end, before)
            hidden.append(h)
            states.append(own)
            before = PrefixState({i: tuple(torch.cat([before.kv[i][j], kv[j]], -2) if i in before.kv else kv[j]
                                           for j in (0, 1)) for i, kv in own.kv.items()}, own.gdn, own.last)
    spans = torch.cat(hidden, dim=1)
    assert (spans - whole).abs().max() < 1e-5 * whole.abs().max()
    assert torch.equal(states[-1].last, spans[:, -1:])
    for key, t in state_whole.named().items():
        assert (before.named()[key] - t).abs().max() < 1e-5 * t.abs().max(), key


def test_the_chain_rule_in_two_parts_equals_one_backward():
    """P's graph from x makes a state; its consumers' loss reads the leaves, one tensor (the last row) unread; the
    consumers' backward, then backward_through with an extra loss, gives x the gradient of one backward of
    consumers + extra through the whole graph. The root is gathered first (FSDP's unshard)."""
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)

    def produce(x):
        return PrefixState({0: (x.sin()[None, None], (2 * x)[None, None])}, {1: (x.exp()[None], x.cos()[None, None])},
                           x.sum(0)[None, None])

    def consume(s):
        (k, v), (tail, st) = s.kv[0], s.gdn[1]
        return (k * v).sum() + (tail ** 2).sum() * st.sum()

    expected, = torch.autograd.grad(consume(produce(x)) + (x ** 3).sum(), x)
    state = produce(x)
    leaves = state.leaves(True)
    consume(leaves).backward()
    grads = leaves.grads()
    assert grads[("last",)] is None and grads[("kv", 0, 1)] is not None

    class Root:
        unsharded = 0

        def unshard(self):
            self.unsharded += 1

    root = Root()
    backward_through(root, state, grads, losses=((x ** 3).sum(),))
    assert root.unsharded == 1
    torch.testing.assert_close(x.grad, expected, rtol=1e-12, atol=0)
