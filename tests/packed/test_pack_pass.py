"""What the patched layers of one packed forward read (packtrain/packed/pack_pass.py): a PackPass hands each layer's
call to the packed kernels with its buffer and its optional parts, records every continuation's own state per layer
in a generation's item pass, answers kv_only's first row with gradient per layer, and refuses the combinations that
mean nothing. The kernels are stand-ins that echo their arguments (what they compute: test_attention.py and
test_gdn.py); an item pass's record decoded against transformers: test_decode.py."""

import types

import pytest
import torch

from packtrain.packed import pack_pass
from packtrain.packed.layout import Continuation, build_pack_layout
from packtrain.packed.pack_pass import ItemRecord, PackPass
from packtrain.packed.prefix import PrefixState


@pytest.fixture
def echo_kernels(monkeypatch):
    """The two kernels replaced by functions returning what they were given."""
    monkeypatch.setattr(pack_pass, "pack_attention", lambda *args: ("attention", args))

    def gdn(module, hidden, layout, prefix, states=False):
        out = ("gdn", module, hidden, layout, prefix)
        return (out, f"conv {module.layer_idx}", f"state {module.layer_idx}") if states else out

    monkeypatch.setattr(pack_pass, "packed_gdn_forward", gdn)


def _layout():
    return build_pack_layout([1, 2], [Continuation([3], [4]), Continuation([], [5])])


@pytest.mark.usefixtures("echo_kernels")
def test_an_item_pass_records_each_layers_own_keys_values_and_gdn_states():
    layout, prefix, record = _layout(), PrefixState(), ItemRecord()
    run = PackPass(layout, prefix=prefix, record=record)
    attention, gdn = types.SimpleNamespace(layer_idx=3), types.SimpleNamespace(layer_idx=1)
    k, v = torch.ones(1), torch.zeros(1)
    assert run.attention(attention, "q", k, v, 0.5, 0.0) == ("attention", (attention, "q", k, v, layout, 0.5, 0.0,
                                                                           prefix, None))
    assert run.gated_deltanet(gdn, "h") == ("gdn", gdn, "h", layout, prefix)
    assert record.keys_values == {3: (k, v)}
    assert (record.conv_states, record.recurrent_states) == ({1: "conv 1"}, {1: "state 1"})
    assert run.grad_rows_from(1) is None  # every row: kv_only's row-sparse backward is a whole pack's


@pytest.mark.usefixtures("echo_kernels")
def test_a_whole_pack_passes_kv_onlys_rows_and_asks_for_no_states():
    layout = _layout()
    run = PackPass(layout, keep_from=(2, 0, 3))
    attention, gdn = types.SimpleNamespace(layer_idx=0), types.SimpleNamespace(layer_idx=1)
    assert run.attention(attention, "q", "k", "v", None, 0.1) == ("attention", (attention, "q", "k", "v", layout,
                                                                                None, 0.1, None, (2, 0, 3)))
    assert run.gated_deltanet(gdn, "h") == ("gdn", gdn, "h", layout, None)
    assert [run.grad_rows_from(i) for i in range(3)] == [2, 0, 3]


def test_an_item_record_without_p_and_kv_only_rows_with_p_are_refused():
    with pytest.raises(ValueError, match="an item record needs P's state from outside"):
        PackPass(_layout(), record=ItemRecord())
    with pytest.raises(ValueError, match="keep_from is kv_only's on a whole pack"):
        PackPass(_layout(), prefix=PrefixState(), keep_from=(2,))
