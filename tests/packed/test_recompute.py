"""What the patched model recomputes in backward instead of keeping (packtrain/packed/recompute.py): the dense MLP
in recomputed tiles of rows (``train.mlp_chunk_rows``) and the RMSNorms in tiles (``train.norm_chunk_rows``).

The tiles' exactness against standalone and transformers runs in the parity tests (tests/packed/test_parity.py,
tests/packed/test_families.py, tests/packed/test_vlm.py, tests/packed/test_walk.py at 7-row MLP and 5-row norm
tiles), kv_only's row-sparse
backward across tiles in tests/packed/test_context_grad.py; here: what is saved, dropout under the recompute, the config
key, the norms."""


import pytest
import torch
from cli_helpers import TINY_MODEL
from parity import compare, max_rel, packed_run, without_float32_casts
from test_groups import _peak_saved_bytes
from tiny_models import patched_lora_model, random_pack, with_lora_dropout
from transformers.models.qwen3 import modeling_qwen3 as hf_qwen3
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf_moe
from transformers.models.qwen3_next import modeling_qwen3_next as hf_next

from packtrain.config import config_from_dict
from packtrain.models.build import build_base_model
from packtrain.models.wrap import assemble
from packtrain.packed import recompute, rowsparse
from packtrain.packed.kernels import Backend
from packtrain.packed.layout import build_pack_layout
from packtrain.packed.lm import PackCall, PackedLM

L, F = "linear_attention", "full_attention"
TILES = Backend(gdn="torch", attention="batched", mlp_rows=7)
INTERMEDIATE = 48  # tiny_lora_model's intermediate_size, a width no other activation of it has


def _saved_activations(model, prefix, conts):
    """The shapes of the tensors other than parameters that autograd saves in one packed forward."""
    shapes = []

    def pack(t):
        if not isinstance(t, torch.nn.Parameter):
            shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        PackedLM(model)(PackCall(build_pack_layout(prefix, conts)))
    return shapes


def test_tiles_keep_no_intermediate_activation_for_backward():
    """A packed forward in 7-row tiles saves no activation of the intermediate width for backward (the MLP keeps its
    input, which the layer holds anyway); the whole MLP saves at least four [T, intermediate] per layer (what the
    activation, the product and down_proj with its LoRA read), and the bytes saved drop by at least those."""
    prefix, conts = random_pack(40, [(3, 5), (30, 9)], seed=3)
    rows = 40 + 3 + 5 + 30 + 9
    saved = {}
    for name, backend in (("whole", Backend(gdn="torch", attention="batched")), ("tiles", TILES)):
        model = patched_lora_model([L, F, L], seed=3, backend=backend)
        wide = [s for s in _saved_activations(model, prefix, conts) if s[-1:] == (INTERMEDIATE,)]
        saved[name] = wide, _peak_saved_bytes(lambda m=model: PackedLM(m)(PackCall(build_pack_layout(prefix, conts))))
    assert saved["tiles"][0] == []
    assert len([s for s in saved["whole"][0] if rows in s]) >= 4 * 3
    assert saved["whole"][1] - saved["tiles"][1] >= 4 * 3 * rows * INTERMEDIATE * 8


def _kept_tiles(forward, rows, n, start, rng, rowsparse, x, *params):
    """The same tiles with every tile's graph kept for backward (no recompute)."""
    return torch.cat([recompute._tile(forward, [recompute._rows(x, offset, rows)], offset, start, rowsparse)
                      for offset in range(0, x.shape[-2], rows)], dim=-2)


def test_dropout_in_a_tile_draws_the_same_mask_in_its_recompute(monkeypatch):
    """LoRA dropout on gate_proj, up_proj and down_proj inside 7-row tiles: each tile's recompute starts from the
    RNG state its forward drew from, so it draws the forward's masks: the losses equal, bit for bit, those of the
    same tiles kept for backward (same seed), and the gradients to float64 rounding (the recompute sums a weight's
    gradient over tiles itself; another mask changes them by more than 1e-2)."""
    model = with_lora_dropout(patched_lora_model([L, F, L], seed=4, backend=TILES), 0.3)
    prefix, conts = random_pack(20, [(5, 6), (30, 4)], seed=4)
    torch.manual_seed(1)
    la, ga = packed_run(model, prefix, conts)
    monkeypatch.setattr(recompute._Tiles, "apply", _kept_tiles)
    torch.manual_seed(1)
    lb, gb = packed_run(model, prefix, conts)
    assert la == lb
    assert ga.keys() == gb.keys() and max_rel(ga, gb) < 1e-13
    torch.manual_seed(2)
    assert packed_run(model, prefix, conts)[0] != la  # the masks matter


@pytest.mark.parametrize("mode", ["full", "kv_only", "frozen"])
def test_each_mode_in_7_row_tiles_packed_equals_standalone(mode, monkeypatch):
    """P of 40 rows: tiles wholly in P, across its end and after it, packed and standalone."""
    with without_float32_casts(monkeypatch):
        model = patched_lora_model([L, F, L], seed=2, backend=TILES)
        prefix, conts = random_pack(40, [(0, 3), (20, 9), (33, 12)], seed=2)
        d = compare(model, prefix, conts, context_grad=mode)
    assert d.loss < 1e-13 and d.grad < 5e-7, d


def test_kv_only_recompute_runs_the_row_sparse_backward_again(monkeypatch):
    """A tile's recompute runs in backward, outside the forward's row-sparse mode: it enters it again, so the MLP's
    linears keep only the rows from P's end, counted from the tile's first row (P 40: tiles wholly in P keep none
    of their 7 rows, the one across P's end keeps from row 5, the last layer's from row 4, later tiles all).
    Gradients alone cannot tell: dense is the same sum over rows whose gradient is zero."""
    starts = []
    inner = rowsparse._RowSparseLinear.forward

    def forward(ctx, x, weight, bias, start):
        if x.shape[-2] <= 7:  # a tile's rows (the other row-sparse linears run over the whole buffer)
            starts.append(start)
        return inner(ctx, x, weight, bias, start)

    monkeypatch.setattr(rowsparse._RowSparseLinear, "forward", staticmethod(forward))
    model = patched_lora_model([L, F, L], seed=2, backend=TILES)
    prefix, conts = random_pack(40, [(0, 3), (20, 9), (33, 12)], seed=2)
    packed_run(model, prefix, conts, context_grad="kv_only")
    assert {0, 4, 5, 7} <= set(starts)


CHOSEN = {"activation_checkpointing": False, "offload": False, "loss_chunk_rows": 0}


@pytest.mark.parametrize("rows,expected", [(None, 512), (0, None), (7, 7)])
def test_mlp_chunk_rows_reaches_the_back_end(rows, expected):
    cfg = config_from_dict({"model": {"config": TINY_MODEL, "dtype": "float64", "kernels": "torch"},
                            "lora": {"r": 4, "alpha": 8},
                            "train": {**CHOSEN, "mlp_chunk_rows": rows, "norm_chunk_rows": 5}})
    _, _, backend = assemble(build_base_model(cfg), cfg, "cpu")
    assert backend.mlp_rows == expected and backend.norm_rows == 5
    assert (f"mlp=recomputed tiles of {expected} rows" if expected else "mlp=whole") in backend.describe()
    assert "rmsnorm=recomputed tiles of 5 rows" in backend.describe()


def test_a_training_model_refuses_savings_left_auto():
    """assemble for training takes the chosen savings (packtrain.run.units.choose_savings); auto is not a value."""
    cfg = config_from_dict({"model": {"config": TINY_MODEL, "dtype": "float64", "kernels": "torch"},
                            "lora": {"r": 4, "alpha": 8}, "train": {**CHOSEN, "mlp_chunk_rows": 0}})
    with pytest.raises(ValueError, match="train.norm_chunk_rows still auto"):
        assemble(build_base_model(cfg), cfg, "cpu")
    # a model that only runs forwards without grad takes the device's tiles where they are auto (they recompute
    # nothing there), the given values where given
    _, lm, backend = assemble(build_base_model(cfg), cfg, "cpu", training=False)
    assert (backend.mlp_rows, backend.norm_rows, lm.loss_chunk_rows) == (None, 512, 0)
    auto = config_from_dict({"model": {"config": TINY_MODEL, "dtype": "float64", "kernels": "torch"},
                             "lora": {"r": 4, "alpha": 8}})
    _, lm, backend = assemble(build_base_model(auto), auto, "cpu", training=False)
    assert (backend.mlp_rows, backend.norm_rows, lm.loss_chunk_rows) == (512, 512, 256)


# -- RMSNorms --------------------------------------------------------------------------------------------------
# (class, takes a gate): every RMSNorm of the supported families' text stacks
NORMS = [(hf.Qwen3_5RMSNorm, False), (hf.Qwen3_5RMSNormGated, True), (hf_moe.Qwen3_5MoeRMSNorm, False),
         (hf_moe.Qwen3_5MoeRMSNormGated, True), (hf_next.Qwen3NextRMSNorm, False),
         (hf_next.Qwen3NextRMSNormGated, True), (hf_qwen3.Qwen3RMSNorm, False)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
@pytest.mark.parametrize("cls,gated", NORMS, ids=[c.__name__ for c, _ in NORMS])
def test_norm_in_tiles_saves_only_its_inputs_and_gives_the_same_bits(cls, gated, dtype):
    """In 5-row tiles (of the hidden width: 10 rows of a norm half as wide): saved for backward, the input (and gate)
    in the model's dtype, where transformers' forward keeps float32 copies of the input and of the normalised rows.
    The output and the input and gate gradients are the class's own, bit for bit (a row's norm is its own
    computation); the weight's gradient is summed over tiles, to float32 rounding."""
    torch.manual_seed(0)
    T, D = 64, 256
    norm = cls(D).to(dtype)
    with torch.no_grad():
        norm.weight.normal_(0.0, 0.5)
    inputs = [torch.randn(1, T, D, dtype=dtype, requires_grad=True) for _ in range(2 if gated else 1)]
    upstream = torch.randn(1, T, D, dtype=dtype)

    def run(forward):
        for t in [*inputs, norm.weight]:
            t.grad = None
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: (saved.append(t), t)[1], lambda t: t):
            out = forward(*inputs)
        out.backward(upstream)
        return out, [t.grad for t in [*inputs, norm.weight]], saved

    out_a, grads_a, saved_a = run(norm)
    tiles = []
    real = recompute._Tiles.forward

    def counted(ctx, forward, rows, *rest):
        tiles.append(rows)
        return real(ctx, forward, rows, *rest)

    recompute._Tiles.forward = staticmethod(counted)
    try:
        out_b, grads_b, saved_b = run(lambda *x: recompute.tiled_norm(norm, 5, 2 * D, *x))
    finally:
        recompute._Tiles.forward = staticmethod(real)
    assert tiles == [10]
    assert torch.equal(out_a, out_b)
    assert all(torch.equal(a, b) for a, b in zip(grads_a[:-1], grads_b[:-1]))
    # the weight's gradient: float32 row sums (the norms compute in float32) added tile by tile
    assert max_rel({"w": grads_b[-1]}, {"w": grads_a[-1]}) < (2e-2 if dtype == torch.bfloat16 else 1e-6)
    # the weight is saved, trained; torch 2.11's checkpoint also saves an empty placeholder: 0 bytes
    activations = [t for t in saved_b if t.numel() and t.data_ptr() != norm.weight.data_ptr()]
    assert [(t.numel(), t.dtype) for t in activations] == [(x.numel(), dtype) for x in inputs]
    if dtype == torch.bfloat16:
        assert sum(t.numel() * t.element_size() for t in saved_a) >= 2 * T * D * 4  # two float32 copies


def test_a_norms_float32_pieces_exist_one_tile_at_a_time():
    """The largest float32 tensor a tiled norm's forward and backward make is one tile's, [rows, D]; transformers'
    backward makes them over every row."""
    T, D, rows = 96, 32, 8
    norm = hf.Qwen3_5RMSNorm(D).to(torch.bfloat16)
    x = torch.randn(T, D, dtype=torch.bfloat16, requires_grad=True)
    largest = {}

    class Largest(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, kinds, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                    largest[self.name] = max(largest.get(self.name, 0), t.numel())
            return out

    for name, forward in (("whole", norm), ("tiles", lambda h: recompute.tiled_norm(norm, rows, D, h))):
        mode = Largest()
        mode.name = name
        with mode:
            forward(x).sum().backward()
    assert largest["tiles"] == rows * D
    assert largest["whole"] == T * D


def test_patch_model_tiles_every_norm_of_the_text_stack(monkeypatch):
    from packtrain.packed import patch

    model = patched_lora_model([L, F], seed=1, backend=Backend(gdn="torch", attention="batched", norm_rows=5))
    norms = [m for m in model.modules() if recompute.is_rmsnorm(m)]
    # 2 per layer, q_norm and k_norm, the gated norm, the final norm
    assert len(norms) == 2 * 2 + 2 + 1 + 1
    assert all(m.forward.__func__ is patch._norm_forward for m in norms)
    called = []

    def seen(m, rows, width, *args):
        called.append((m, rows, width))
        return type(m).forward(m, *args)

    monkeypatch.setattr(patch, "tiled_norm", seen)
    prefix, conts = random_pack(9, [(3, 4)], seed=1)
    packed_run(model, prefix, conts)
    assert {id(m) for m, _, _ in called} == {id(m) for m in norms}  # every norm, in 5-row tiles of the hidden width
    assert {(rows, width) for _, rows, width in called} == {(5, 32)}
