"""LoRA in the model's dtype (packtrain.models.lora_compute) against peft's own ``lora.Linear.forward`` and the plain
formula under autograd: float64 to 1e-12, bf16 within its rounding, dropout masks replayed from the RNG state (also
in a checkpoint's recompute), and what autograd saves for q/k/v on one input."""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from cli_helpers import TINY_MODEL
from parity import peft_lora_forward, rel
from peft import LoraConfig, inject_adapter_in_model
from peft.tuners.lora.layer import Linear as PeftLoraLinear
from tiny_models import tiny_lora_model
from torch import nn
from torch.utils.checkpoint import checkpoint

from packtrain.config import config_from_dict
from packtrain.models.build import apply_lora, build_base_model
from packtrain.models.lora_compute import describe, lora_forward

U = 2.0**-8  # bf16's unit roundoff
QKV = ("q_proj", "k_proj", "v_proj")


def _attention(dtype, seed=0, dropout=0.0):
    """The one attention layer of a tiny random model with random A and B on every projection."""
    attn = tiny_lora_model(["full_attention"], dtype=dtype, seed=seed).get_base_model().model.layers[0].self_attn
    if dropout:
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(attn, name).lora_dropout["default"] = nn.Dropout(dropout)
    return attn


def _weights(layer):
    return layer.lora_A["default"].weight, layer.lora_B["default"].weight


def _run(layer, forward, x, g):
    """The output and the gradients of x, A and B for the upstream gradient g."""
    layer.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    y = forward(layer, x)
    y.backward(g)
    return [y.detach(), x.grad, *(w.grad for w in _weights(layer))]


def _inputs(layer, dtype, rows=9, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, rows, layer.in_features, generator=gen, dtype=torch.float64).to(dtype)
    return x, torch.randn(1, rows, layer.out_features, generator=gen, dtype=torch.float64).to(dtype)


@pytest.mark.parametrize("proj", ["q_proj", "k_proj", "o_proj"])
def test_float64_equals_peft(proj):
    layer = getattr(_attention(torch.float64), proj)
    x, g = _inputs(layer, torch.float64)
    ours, peft = _run(layer, lora_forward, x, g), _run(layer, PeftLoraLinear.forward, x, g)
    for a, b in zip(ours, peft):
        assert rel(a, b) < 1e-12


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("proj", ["q_proj", "o_proj"])
def test_bfloat16_within_its_rounding_of_peft(proj, seed):
    """A bf16 model, float32 adapters. peft computes the delta in float32; this forward rounds A and B * scaling to
    bf16 and the [T, r] product (or its gradient) once: three roundings on every path, each at most U times the
    product of absolute values P (|x| |A|^T |B|^T s for the output), so |ours - peft| <= 3 U P to first order, plus
    the final rounding of a bf16 result in each (2 U |result|). Measured: at most 1.0 U P beyond that, 8 seeds."""
    layer = getattr(_attention(torch.bfloat16, seed), proj)
    x, g = _inputs(layer, torch.bfloat16, rows=50, seed=seed)
    ours, peft = _run(layer, lora_forward, x, g), _run(layer, PeftLoraLinear.forward, x, g)
    assert [t.dtype for t in ours] == [torch.bfloat16, torch.bfloat16, torch.float32, torch.float32]
    A, B = (w.detach().double().abs() for w in _weights(layer))
    s = layer.scaling["default"]
    X, G = x[0].double().abs(), g[0].double().abs()
    products = [X @ A.T @ B.T * s, G @ B @ A * s, (G @ B * s).T @ X, G.T @ (X @ A.T) * s]
    for i, (a, b, P) in enumerate(zip(ours, peft, products)):
        a, b = a.double().reshape(P.shape), b.double().reshape(P.shape)
        rounded_result = 2 * U * b.abs() if i < 2 else 0  # the output and dx are bf16
        assert ((a - b).abs() <= rounded_result + 3 * U * P).all(), i


def _plain(layer, x, mask):
    """LoRA's formula under autograd, the base layer as peft runs it."""
    A, B = _weights(layer)
    return layer.base_layer(x) + (x * mask) @ A.T @ B.T * layer.scaling["default"]


def test_dropout_gradient_is_the_plain_formula_with_the_same_mask():
    layer = _attention(torch.float64, dropout=0.3).q_proj
    x, g = _inputs(layer, torch.float64, rows=40)
    torch.manual_seed(7)
    ours = _run(layer, lora_forward, x, g)
    torch.manual_seed(7)  # nn.Dropout's mask for this input, drawn again from the same RNG state
    mask = F.dropout(torch.ones_like(x), 0.3, training=True)
    assert 0 < (mask == 0).sum() < mask.numel() // 2
    plain = _run(layer, lambda m, x: _plain(m, x, mask), x, g)
    torch.manual_seed(7)
    peft = _run(layer, PeftLoraLinear.forward, x, g)
    for a, b, c in zip(ours, plain, peft):
        assert rel(a, b) < 1e-12 and rel(a, c) < 1e-12


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_the_rng_moves_as_under_peft(dropout):
    """Forward draws what nn.Dropout draws (nothing with dropout 0, or in eval mode) and backward draws nothing
    from the global stream, so every later draw of a run (the next adapter's mask) is the one peft's run makes."""
    layer = _attention(torch.float64, dropout=dropout).q_proj
    x, g = _inputs(layer, torch.float64)
    after = {}
    for name, forward in (("packtrain", lora_forward), ("peft", PeftLoraLinear.forward)):
        torch.manual_seed(11)
        y = forward(layer, x.detach().requires_grad_())
        torch.rand(1)  # a later draw (another layer's mask) between this forward and its backward
        y.backward(g)
        after[name] = torch.get_rng_state()
    assert torch.equal(after["packtrain"], after["peft"])
    torch.manual_seed(11)
    torch.rand(1)
    assert torch.equal(after["packtrain"], torch.get_rng_state()) == (dropout == 0)
    seeded = torch.manual_seed(11).get_state()
    _run(layer.eval(), lora_forward, x, g)
    assert torch.equal(torch.get_rng_state(), seeded)


def _qkv(attn, x):
    return torch.cat([getattr(attn, name)(x) for name in QKV], dim=-1)


def _qkv_grads(attn, x, g, seed, checkpointed=False):
    """Output and gradients (x, every A and B) of q, k and v on one input, each adapter with its own mask."""
    attn.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    torch.manual_seed(seed)
    y = checkpoint(_qkv, attn, x, use_reentrant=False) if checkpointed else _qkv(attn, x)
    y.backward(g)
    return [y.detach(), x.grad] + [w.grad for name in QKV for w in _weights(getattr(attn, name))]


def test_dropout_is_seeded_and_replayed_in_a_checkpoint_recompute():
    attn = _attention(torch.float32, dropout=0.2)
    x, _ = _inputs(attn.q_proj, torch.float32, rows=30)
    g = torch.randn(1, 30, sum(getattr(attn, n).out_features for n in QKV))
    first, again = _qkv_grads(attn, x, g, seed=3), _qkv_grads(attn, x, g, seed=3)
    other = _qkv_grads(attn, x, g, seed=4)
    recomputed = _qkv_grads(attn, x, g, seed=3, checkpointed=True)
    for a, b, c in zip(first, again, recomputed):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert not torch.equal(first[1], other[1])  # the masks are live: another seed, other gradients


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_masks_are_seeded_replayed_and_give_the_plain_gradient():
    """CUDA's generator: the same seed gives the same masks, a checkpoint's recompute and backward draw them again,
    and the gradient is the plain formula's with the mask drawn as lora_compute draws it (``bernoulli_``; CUDA's
    fused ``F.dropout`` draws another one). float32, TF32 off (torch's default for matmul)."""
    attn = _attention(torch.float32, dropout=0.2).cuda()
    x, _ = _inputs(attn.q_proj, torch.float32, rows=30)
    x, g = x.cuda(), torch.randn(1, 30, sum(getattr(attn, n).out_features for n in QKV)).cuda()
    first, again = _qkv_grads(attn, x, g, seed=3), _qkv_grads(attn, x, g, seed=3)
    recomputed = _qkv_grads(attn, x, g, seed=3, checkpointed=True)
    for a, b, c in zip(first, again, recomputed):
        assert torch.equal(a, b) and torch.equal(a, c)
    layer, g = attn.q_proj, g[..., :attn.q_proj.out_features].contiguous()
    torch.manual_seed(7)
    ours = _run(layer, lora_forward, x, g)
    torch.manual_seed(7)
    mask = torch.empty_like(x).bernoulli_(0.8).div_(0.8)
    plain = _run(layer, lambda m, x: _plain(m, x, mask), x, g)
    for a, b in zip(ours, plain):
        assert rel(a, b) < 1e-5


def _saved(fn, params):
    """Every tensor autograd saves while ``fn()`` runs, parameters left out: (storage key, shape, dtype, bytes)."""
    saved = []

    def pack(t):
        if t.data_ptr() not in params:
            saved.append((t.untyped_storage().data_ptr(), tuple(t.shape), t.dtype, t.untyped_storage().nbytes()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return saved


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("forward", ["packtrain", "peft"])
def test_qkv_save_their_one_bf16_input_once(dropout, forward):
    """q, k, v on one bf16 input: packtrain's forward saves that input once (the tensor itself) and each adapter's
    [T, r] product; peft's saves a float32 copy of the input per adapter (and its mask with dropout)."""
    attn = _attention(torch.bfloat16, dropout=dropout)
    T, r = 64, attn.q_proj.r["default"]
    x = torch.randn(1, T, attn.q_proj.in_features, dtype=torch.bfloat16, requires_grad=True)
    params = {p.data_ptr() for p in attn.parameters()}
    with peft_lora_forward(attn) if forward == "peft" else contextlib.nullcontext():
        saved = _saved(lambda: _qkv(attn, x), params)
    wide = {(key, shape) for key, shape, dtype, _ in saved if dtype == torch.float32 and shape[-2:-1] == (T,)
            and shape[-1] > r}
    if forward == "peft":
        assert len(wide) >= 3  # the meter sees the float32 copies
        return
    assert not wide
    by_storage = {key: nbytes for key, _, _, nbytes in saved}
    assert x.untyped_storage().data_ptr() in by_storage
    assert sum(by_storage.values()) == x.nbytes + 3 * T * r * 2


def _tiny_config(**lora):
    return config_from_dict({"model": {"config": TINY_MODEL, "dtype": "float64"}, "lora": lora})


def _model_loss_and_grads(model, ids, seed):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def test_apply_lora_installs_it_and_a_run_equals_peft():
    """Through the config (rsLoRA scaling, dropout): every adapted linear runs packtrain's forward, and one
    training forward and backward equals peft's under the same seed (the same masks) in float64."""
    cfg = _tiny_config(r=4, alpha=8, dropout=0.1, use_rslora=True,
                       target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "in_proj_qkv"])
    model = apply_lora(build_base_model(cfg), cfg).train()
    layers = [m for m in model.modules() if isinstance(m, PeftLoraLinear)]
    assert layers and all(m.forward.__func__ is lora_forward for m in layers)
    assert layers[0].scaling["default"] == 8 / 4**0.5
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.1)
    ids = torch.randint(0, TINY_MODEL["vocab_size"], (1, 24), generator=torch.Generator().manual_seed(0))
    loss, grads = _model_loss_and_grads(model, ids, seed=5)
    with peft_lora_forward(model):
        peft_loss, peft_grads = _model_loss_and_grads(model, ids, seed=5)
    assert rel(loss, peft_loss) < 1e-12
    for n, g in peft_grads.items():
        assert g.abs().max() > 0 and rel(grads[n], g) < 1e-12, n


def _same_as_peft(model, fn):
    ours = fn()
    with peft_lora_forward(model):
        assert torch.equal(ours, fn())


def test_two_active_adapters_and_what_goes_to_peft():
    """Two active adapters add up as in peft; disabled, merged and DoRA adapters run peft's own forward."""
    model = tiny_lora_model(["full_attention"])
    model.add_adapter("other", LoraConfig(r=2, lora_alpha=3, target_modules=["q_proj", "o_proj"],
                                          init_lora_weights=False))
    model.base_model.set_adapter(["default", "other"])
    ids = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(1))
    loss, grads = _model_loss_and_grads(model, ids, seed=0)
    with peft_lora_forward(model):
        peft_loss, peft_grads = _model_loss_and_grads(model, ids, seed=0)
    assert any(".other." in n for n in grads)
    assert rel(loss, peft_loss) < 1e-12
    for n, g in peft_grads.items():
        assert rel(grads[n], g) < 1e-12, n
    with torch.no_grad():
        with model.disable_adapter():
            _same_as_peft(model, lambda: model(input_ids=ids).logits)
        model.merge_adapter()
        _same_as_peft(model, lambda: model(input_ids=ids).logits)
    dora = inject_adapter_in_model(LoraConfig(r=2, target_modules=["0"], use_dora=True, init_lora_weights=False),
                                   nn.Sequential(nn.Linear(5, 3)).double())
    layer = dora[0]
    x, g = _inputs(layer, torch.float64)
    assert all(torch.equal(a, b) for a, b in zip(_run(layer, lora_forward, x, g),
                                                 _run(layer, PeftLoraLinear.forward, x, g)))


def test_the_run_header_says_how_lora_computes(trained):
    """7 adapted linears: q, k, v, o of the one attention layer and gate_proj of each of the three layers."""
    assert ("LoRA compute: 7 adapted linears in float64 (float64 weights and gradients; no float32 input copies), "
            "no dropout") in trained().stdout
    cfg = config_from_dict({"model": {"config": TINY_MODEL, "dtype": "bfloat16"}, "lora": {"dropout": 0.05}})
    assert describe(apply_lora(build_base_model(cfg), cfg)) == (
        "LoRA compute: 7 adapted linears in bfloat16 (float32 weights and gradients; no float32 input copies), "
        "dropout 0.05, masks drawn again in backward")
