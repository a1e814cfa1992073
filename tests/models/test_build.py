"""The base model and LoRA on it (packtrain/models/build.py): a ``model.config`` base seeded from ``model.seed`` and
saved where transformers loads it, the refusals of a base that is not there, an adapter on a meta-device base equal to
the one on the loaded base, and a float64 MoE on the experts' per-expert loop. Which families and LoRA targets are
refused: tests/packed/test_families.py."""

import pytest
import torch
from cli_helpers import TINY_MODEL
from tiny_models import FAMILY_CONFIGS

from packtrain.config import config_from_dict
from packtrain.models.build import apply_lora, build_base_model

L, F = "linear_attention", "full_attention"


def _cfg(model: dict, **lora):
    return config_from_dict({"model": {"dtype": "float32", "kernels": "torch", **model},
                             "lora": {"r": 4, "alpha": 8, "dropout": 0.0, **lora}, "train": {"seed": 3}})


def _tensors(model) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def test_a_config_base_is_seeded_and_saved_where_transformers_loads_it(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM, Qwen3_5ForCausalLM

    model = build_base_model(_cfg({"config": TINY_MODEL, "seed": 5}), save_to=tmp_path / "base")
    raw = dict(TINY_MODEL)
    torch.manual_seed(5)
    reference = Qwen3_5ForCausalLM(AutoConfig.for_model(raw.pop("model_type"), **raw))  # transformers' own init
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    for other in (reference, loaded):
        theirs = _tensors(other)
        assert {n: t.shape for n, t in _tensors(model).items()} == {n: t.shape for n, t in theirs.items()}
        assert all(torch.equal(t, theirs[n]) for n, t in _tensors(model).items())
    assert not torch.equal(build_base_model(_cfg({"config": TINY_MODEL, "seed": 6})).lm_head.weight,
                           model.lm_head.weight)


def test_a_base_that_is_not_there_is_refused(tmp_path):
    with pytest.raises(ValueError, match=rf"^model.path: {tmp_path} is not a local transformers model directory"):
        build_base_model(_cfg({"path": str(tmp_path)}))
    with pytest.raises(ValueError, match=r"^model: set model.path \(a local model directory\) or model.config"):
        build_base_model(_cfg({}))


@pytest.fixture(scope="module")
def saved_base(tmp_path_factory):
    path = tmp_path_factory.mktemp("base")
    build_base_model(_cfg({"config": TINY_MODEL}), save_to=path)
    return path


def test_an_adapter_on_a_meta_base_equals_the_one_on_the_loaded_base(saved_base):
    """peft makes each adapter on the CPU and moves it to its base layer's device: on a meta base the stand-ins of
    adapters_on_cpu keep the seeded values, and the base's own meta parameters are put back after."""
    cfg = _cfg({"path": str(saved_base)})
    meta_base = build_base_model(cfg, meta=True)
    originals = {n: p for n, p in meta_base.named_parameters()}
    assert all(p.is_meta for p in originals.values())
    meta = apply_lora(meta_base, cfg)
    real = _tensors(apply_lora(build_base_model(cfg), cfg))
    adapters = {n: p for n, p in meta.named_parameters() if p.requires_grad}
    assert adapters and adapters.keys() == {n for n, p in real.items() if p.requires_grad}
    assert all(not p.is_meta and torch.equal(p, real[n]) for n, p in adapters.items())
    frozen = [p for p in meta.parameters() if not p.requires_grad]
    assert len(frozen) == len(originals) and all(p.is_meta for p in frozen)
    assert {id(p) for p in frozen} == {id(p) for p in originals.values()}  # the base's own parameters, put back


def test_a_data_dependent_init_is_refused_on_a_meta_base(saved_base):
    cfg = _cfg({"path": str(saved_base)}, init_lora_weights="pissa")
    with pytest.raises(ValueError, match="lora.init_lora_weights: 'pissa' computes the adapter from the base weights"):
        apply_lora(build_base_model(cfg, meta=True), cfg)


@pytest.mark.parametrize("dtype, expected", [("float64", "eager"), ("float32", "grouped_mm")])
def test_a_float64_moe_runs_the_experts_own_loop(dtype, expected):
    """transformers' grouped_mm has no float64 kernel."""
    moe = {"model_type": "qwen3_5_moe_text", "vocab_size": 97, "num_hidden_layers": 2, "layer_types": [L, F],
           **FAMILY_CONFIGS["qwen3_5_moe_text"]}
    model = build_base_model(_cfg({"config": moe, "dtype": dtype}))
    assert model.config._experts_implementation == expected
    assert model.dtype == getattr(torch, dtype)
