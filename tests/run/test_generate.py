"""Generation through the packed machinery against transformers' own ``generate`` on ``concat(P, item)`` (float64).

P is prefilled once, the items run as continuations of one pack, then every row decodes in one batch
(packtrain/packed/decode.py). The reference is the same peft model's ``generate(do_sample=False)`` one example at a
time (transformers' cache path, its own kernels). Shapes: P shorter than the conv width (2 < 4), P straddling the GDN
chunks (70: transformers' 64, packtrain's 32), items of 0, 1 and many tokens, several layer orders.
"""

import pytest
import torch
from fla_interp import needs_interpreter
from tiny_models import IMAGE, image_item, patched_lora_model, random_pack, tiny_family_model, tiny_lora_model, tiny_vlm

from packtrain.distributed import DistInfo
from packtrain.packed.decode import ItemsCall
from packtrain.packed.kernels import Backend
from packtrain.packed.layout import Continuation, build_pack_layout
from packtrain.packed.lm import PackedLM
from packtrain.packed.patch import patch_model, vision_spec
from packtrain.packed.prefix import PrefixCall
from packtrain.run.generate import GenerateSpec, choose, decode_rows, nucleus, stop_ids

L, F = "linear_attention", "full_attention"
ONE = DistInfo(0, 1, 0, torch.device("cpu"))


def packed_generate(model, prefix, items, spec, images=None, vision=None, ids=None):
    """packtrain's generation of every item on P: {index: Generated}. ``images``: per item (grids, pixels)."""
    lm = PackedLM(model).eval()
    with torch.no_grad():
        nonempty = [i for i, item in enumerate(items) if item]
        conts = [Continuation(items[i], (), images[i][0] if images else ()) for i in nonempty]
        layout = build_pack_layout(prefix, conts, vision, targets=False) if conts else None
        if layout is not None and images:
            pixels = [p for i in nonempty for p in images[i][1]]
            layout.pixel_values = torch.cat(pixels) if pixels else None
        call = layout if layout is not None else build_pack_layout(prefix, [Continuation(prefix[-1:], ())],
                                                                    targets=False)
        state = lm(PrefixCall(call))
        keyed = [(i, len(item), ids[i] if ids else f"ex{i}") for i, item in enumerate(items)]
        return decode_rows(lm, layout, state, len(prefix), keyed, spec, ONE)


def hf_generate(model, prefix, item, spec, images=None):
    """transformers' generate on concat(P, item) alone: the new tokens up to (excluding) a stop token."""
    ids = torch.tensor([list(prefix) + list(item)])
    kw = {}
    if images and images[0]:
        grids, pixels = images
        kw = dict(pixel_values=torch.cat(pixels), image_grid_thw=torch.tensor([list(g) for g in grids]),
                  mm_token_type_ids=(ids == IMAGE).int())
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=spec.max_new_tokens,
                             do_sample=False, eos_token_id=sorted(spec.stop_ids) or None, pad_token_id=0, **kw)
    new = out[0, ids.shape[1]:].tolist()
    for n, t in enumerate(new):
        if t in spec.stop_ids:
            return new[:n], "eos"
    return new, "length"


def assert_same_as_transformers(model, prefix, items, spec, images=None, vision=None):
    ours = packed_generate(model, prefix, items, spec, images, vision)
    assert sorted(ours) == list(range(len(items)))
    for i, item in enumerate(items):
        ids, stop = hf_generate(model, prefix, item, spec, images[i] if images else None)
        assert list(ours[i].ids) == ids and ours[i].stop == stop, (i, len(item), ours[i], ids, stop)
    return ours


def patched(model):
    return patch_model(model, Backend(gdn="torch", attention="batched"))


ITEMS = [(5, 1), (1, 1), (13, 1), (0, 1), (9, 1), (1, 1)]  # item lengths (the target lengths are not used)


@pytest.mark.parametrize("prefix_len", [2, 70])
@pytest.mark.parametrize("layers", [[L, F, L, F], [F, L, L]])
def test_greedy_equals_transformers_text(prefix_len, layers):
    model = patched(tiny_lora_model(layers, seed=1))
    prefix, conts = random_pack(prefix_len, ITEMS, seed=prefix_len)
    ours = assert_same_as_transformers(model, prefix, [c.item_ids for c in conts], GenerateSpec(7, frozenset()))
    assert all(g.stop == "length" and len(g.ids) == 7 for g in ours.values())
    assert len({g.ids for g in ours.values()}) == len(ITEMS)  # the rows are not one row repeated


def test_stop_tokens_end_rows_at_different_steps():
    """Stop tokens taken from what the model generates, so that rows stop at different steps (and one at once)."""
    model = patched(tiny_lora_model([L, F, L], seed=2))
    prefix, conts = random_pack(20, ITEMS, seed=5)
    items = [c.item_ids for c in conts]
    free = packed_generate(model, prefix, items, GenerateSpec(9, frozenset()))
    stops = frozenset({free[0].ids[0], free[2].ids[4]})
    ours = assert_same_as_transformers(model, prefix, items, GenerateSpec(9, stops))
    assert ours[0].ids == () and ours[0].stop == "eos"
    assert {g.stop for g in ours.values()} == {"eos", "length"} or all(g.stop == "eos" for g in ours.values())
    assert len({len(g.ids) for g in ours.values()}) > 1


@pytest.mark.parametrize("model_type,layers", [("qwen3_5_moe_text", [L, F, L]), ("qwen3_next", [L, L, F, L]),
                                               ("qwen3", [F, F])])
def test_greedy_equals_transformers_moe_qwen3_next_and_qwen3(model_type, layers):
    model = patched(tiny_family_model(model_type, layers, seed=3))
    for prefix_len in (3, 70):
        prefix, conts = random_pack(prefix_len, ITEMS, seed=prefix_len + 1)
        assert_same_as_transformers(model, prefix, [c.item_ids for c in conts], GenerateSpec(6, frozenset()))


def test_items_all_empty_decode_from_p_alone():
    """Every continuation its target alone: no item pass over tokens, every row starts from P's own state."""
    model = patched(tiny_lora_model([L, F], seed=6))
    prefix, _ = random_pack(9, [], seed=2)
    ours = assert_same_as_transformers(model, prefix, [(), ()], GenerateSpec(5, frozenset()))
    assert ours[0] == ours[1]


@pytest.mark.parametrize("moe", [False, True])
def test_greedy_equals_transformers_vlm(moe):
    """Images in items (one vision batch for the pack), an item without one and an empty item; M-RoPE positions of
    the generated tokens continue after each item's largest coordinate, as transformers' rope deltas do."""
    model = tiny_vlm(1, moe)
    gen = torch.Generator().manual_seed(4)
    rnd = lambda n: torch.randint(0, 89, (n,), generator=gen).tolist()
    prefix = rnd(37)
    images, items = [], []
    for grids, before, after in [([(1, 4, 6)], 3, 5), ([], 6, 0), ([(1, 4, 4), (1, 6, 2)], 2, 4), ([], 0, 0),
                                 ([(1, 2, 8)], 0, 1)]:
        item, pixels = image_item(rnd(before), grids, rnd(after), gen)
        items.append(item)
        images.append((grids, pixels))
    assert_same_as_transformers(model, prefix, items, GenerateSpec(6, frozenset()), images, vision_spec(model))


def test_sampling_is_seeded_per_example():
    """The same seed gives the same tokens; in another batch (a different order, fewer rows) each example still draws
    the same tokens (its generator is keyed by its id); another seed draws other tokens."""
    model = patched(tiny_lora_model([L, F, L], seed=1))
    prefix, conts = random_pack(12, ITEMS, seed=9)
    items = [c.item_ids for c in conts]
    spec = GenerateSpec(8, frozenset(), temperature=1.5, top_p=0.9, seed=11)
    a = packed_generate(model, prefix, items, spec)
    assert a == packed_generate(model, prefix, items, spec)
    order = [4, 2, 0]
    other = packed_generate(model, prefix, [items[i] for i in order], spec, ids=[f"ex{i}" for i in order])
    assert [other[k] for k in range(3)] == [a[i] for i in order]
    b = packed_generate(model, prefix, items, GenerateSpec(8, frozenset(), temperature=1.5, top_p=0.9, seed=12))
    greedy = packed_generate(model, prefix, items, GenerateSpec(8, frozenset()))
    assert a != b and a != greedy


def test_top_p_keeps_the_nucleus():
    logits = torch.tensor([[3.0, 2.0, 1.0, -5.0]])
    probs = logits.softmax(-1)[0]  # 0.665, 0.245, 0.090, 0.0002
    assert probs[0] < 0.7 < probs[0] + probs[1]
    spec = GenerateSpec(1, frozenset(), temperature=1.0, top_p=0.7, seed=0)
    drawn = {int(choose(logits, spec, [torch.Generator().manual_seed(s)])) for s in range(200)}
    assert drawn == {0, 1}  # the two most likely tokens make the smallest set with mass >= 0.7
    greedy = GenerateSpec(1, frozenset())
    assert int(choose(logits, greedy, [None])) == 0


@pytest.mark.parametrize("top_p", [0.05, 0.3, 0.5, 0.7, 0.86, 0.95, 0.999])
def test_top_p_is_transformers_top_p_warper(top_p):
    """A hand-made distribution in shuffled order, one row per shuffle: the tokens kept (and their scores) are
    those of transformers' TopPLogitsWarper, so the most likely token is never the one dropped."""
    from transformers import TopPLogitsWarper

    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.03, 0.01])
    rows = [torch.randperm(len(probs), generator=torch.Generator().manual_seed(s)) for s in range(4)]
    scores = torch.stack([probs[r].log() for r in rows])
    ours, theirs = nucleus(scores, top_p), TopPLogitsWarper(top_p)(None, scores.clone())
    assert torch.equal(ours.isinf(), theirs.isinf()) and torch.equal(ours, theirs)
    kept = ours.isfinite()
    assert bool(kept[torch.arange(4), scores.argmax(-1)].all())  # the most likely token always stays
    assert kept.sum(-1).tolist() == [int(kept[0].sum())] * 4  # the same tokens whatever their order


def test_stop_ids_hold_im_end_when_the_models_eos_is_another_token():
    from transformers import AutoTokenizer

    from packtrain.data.jsonl import BUNDLED_TOKENIZER

    tokenizer = AutoTokenizer.from_pretrained(BUNDLED_TOKENIZER)
    tokenizer.eos_token = "<|endoftext|>"  # a base model's tokenizer: its eos is not the end of a chat turn
    model = tiny_lora_model(["full_attention"])
    model.config.eos_token_id = 7
    model.generation_config.eos_token_id = 7
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert len({im_end, 7, tokenizer.eos_token_id}) == 3
    assert stop_ids(model, tokenizer) == {7, im_end, tokenizer.eos_token_id}
    assert stop_ids(model) == {7}


@needs_interpreter
def test_the_item_pass_through_fla_kernels_records_the_torch_back_ends_state():
    """Under Triton's interpreter (float32): the items' pass through fla's conv and varlen delta rule (with final
    states) leaves the rows the torch back end leaves, and the first logits agree."""
    from fla_interp import fla_cpu_backend

    prefix, conts = random_pack(5, [(3, 1), (1, 1), (70, 1), (2, 1)], seed=7)
    rows = {}
    for name, backend in (("fla", fla_cpu_backend()), ("torch", Backend("torch", "batched"))):
        model = patched_lora_model([L, F], dtype=torch.float32, seed=4, linear_num_key_heads=1,
                                   linear_num_value_heads=2, backend=backend)
        lm = PackedLM(model).eval()
        with torch.no_grad():
            layout = build_pack_layout(prefix, [Continuation(c.item_ids, ()) for c in conts], targets=False)
            state = lm(PrefixCall(layout))
            rows[name] = lm(ItemsCall(layout, state, len(prefix), 0, 80))
    (logits_a, a), (logits_b, b) = rows["fla"], rows["torch"]
    assert (logits_a - logits_b).abs().max() < 1e-4 * logits_b.abs().max()
    for i in b.gdn:
        for x, y in zip(a.gdn[i], b.gdn[i]):
            assert (x - y).abs().max() <= 1e-5 * y.abs().max(), i
    for i in b.kv:
        for x, y in zip(a.kv[i], b.kv[i]):
            assert torch.equal(x == 0, y == 0) and (x - y).abs().max() <= 1e-5 * y.abs().max()
