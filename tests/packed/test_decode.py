"""Generation's calls on one P (packtrain/packed/decode.py): P, the items as continuations of one pack (one item
empty: its row starts from P's state), then two tokens per row decoded together; every row's logits at every call
equal transformers' own forward of ``concat(P, item, tokens so far)`` alone (peft's LoRA forward, the MLPs whole).
Token identity with ``generate`` over many steps: tests/run/test_generate.py."""

import torch
from parity import peft_lora_forward, transformers_mlp
from tiny_models import patched_lora_model

from packtrain.packed.decode import DecodeCall, ItemsCall
from packtrain.packed.kernels import Backend
from packtrain.packed.layout import Continuation, build_pack_layout
from packtrain.packed.lm import PackedLM
from packtrain.packed.prefix import PrefixCall

L, F = "linear_attention", "full_attention"


def test_items_then_decode_steps_equal_each_sequence_alone():
    model = patched_lora_model([L, F, L], seed=6, backend=Backend("torch", "batched"))
    prefix, items, empty = [3, 14, 15], [[9, 26, 5, 35], [89]], 1
    steps = [[7, 8, 9], [40, 41, 42]]  # one token per row per call
    lm = PackedLM(model).eval()
    with torch.no_grad():
        layout = build_pack_layout(prefix, [Continuation(item, ()) for item in items], targets=False)
        got = [lm(ItemsCall(layout, lm(PrefixCall(layout)), len(prefix), empty, room=6))]
        rows = got[0][1]
        # the next token's position, text and M-RoPE alike for text: |P| + |item|
        assert rows.text.tolist() == rows.mrope.tolist() == [3 + 4, 3 + 1, 3 + 0]
        got = [got[0][0]] + [lm(DecodeCall(rows, torch.tensor(tokens))) for tokens in steps]
        assert rows.lengths.tolist() == [4 + 2, 1 + 2, 0 + 2] and rows.text.tolist() == [3 + 6, 3 + 3, 3 + 2]
        with peft_lora_forward(model), transformers_mlp(model):
            for row, item in enumerate(items + [[]] * empty):
                for call in range(len(steps) + 1):
                    ids = prefix + item + [tokens[row] for tokens in steps[:call]]
                    expected = model(input_ids=torch.tensor([ids])).logits[0, -1]
                    # transformers' GDN computes in float32 inside a float64 model
                    assert (got[call][row] - expected).abs().max() < 1e-5 * expected.abs().max(), (row, call)
