"""Load the base model (a local directory, or a config dict with random init) and put LoRA on it.

No downloads: ``model.path`` must be a local transformers directory. A random model built from
``model.config`` is saved to ``OUTPUT/base/`` so any tool (peft, transformers) can load the base the adapter
belongs to. ``model.adapter`` (a trained adapter, the run's start) is folded into the base here, whatever builds it
(:mod:`packtrain.models.start_adapter`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from torch import nn

from packtrain.config import Config
from packtrain.models import lora_compute
from packtrain.models.loading import SafetensorsCheckpoint, WeightMap, materialize, module_names, real_tensors
from packtrain.models.start_adapter import StartAdapter, fold_base, read_start
from packtrain.packed.families import (
    ROUTER,
    check_built_config,
    check_config_dict,
    config_dict,
    family_for_type,
    family_of,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def model_class_for(model_type: str, where: str = "model.config.model_type"):
    import transformers

    return getattr(transformers, family_for_type(model_type, where).class_name)


def _finish(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Routed experts: transformers' default grouped_mm has no float64 kernel, so a float64 model runs the
    experts' own per-expert loop (the same maths)."""
    if dtype == torch.float64 and family_of(model).moe:
        model.set_experts_implementation("eager")
    return model


def build_base_model(cfg: Config, save_to: Path | None = None, meta: bool = False,
                     start: StartAdapter | None = None) -> nn.Module:
    """The base model in ``model.dtype``; from ``model.config`` it is seeded and saved to ``save_to``. With
    ``model.adapter`` (``start``: its chain, read already; else read here) the adapter is folded in: in place after
    a ``model.config`` build (``save_to`` keeps the random init), while reading from ``model.path``.

    ``meta``: a ``model.path`` model is built without weights (parameters on the meta device, buffers computed
    on the CPU); :func:`packtrain.models.wrap.assemble` fills it after wrapping, each rank its own shards."""
    from transformers import AutoConfig

    dtype = DTYPES[cfg.model.dtype]
    start = start if start is not None else read_start(cfg)
    if cfg.model.path is not None:
        path = cfg.resolve_path(cfg.model.path)
        if not (path / "config.json").is_file():
            raise ValueError(f"model.path: {path} is not a local transformers model directory (no config.json)")
        family = check_config_dict(config_dict(cfg), f"{path / 'config.json'}")
        SafetensorsCheckpoint(path).check_files()  # a truncated shard: one line naming it, before any build
        hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
        check_built_config(family, hf_config, f"{path / 'config.json'}")
        cls = model_class_for(hf_config.model_type)
        if meta:
            return fold_base(_finish(empty_model(cls, hf_config, dtype), dtype), start)
        if start is not None:  # read as the sharded load reads, folding each tensor: one fold for every loader
            return _filled(fold_base(_finish(empty_model(cls, hf_config, dtype), dtype), start), path)
        model = cls.from_pretrained(path, dtype=dtype, local_files_only=True, attn_implementation="sdpa")
        return _finish(model, dtype)
    if cfg.model.config is None:
        raise ValueError("model: set model.path (a local model directory) or model.config (a config dict)")
    raw = dict(cfg.model.config)
    family = check_config_dict(raw)
    model_type = raw.pop("model_type")
    cls = model_class_for(model_type)
    try:
        hf_config = AutoConfig.for_model(model_type, **raw)
    except (TypeError, ValueError) as e:
        raise ValueError(f"model.config: {e}") from None
    check_built_config(family, hf_config)
    hf_config._attn_implementation = "sdpa"
    torch.manual_seed(cfg.model.seed)
    model = _finish(cls(hf_config).to(dtype), dtype)
    if save_to is not None:
        model.save_pretrained(save_to)
    return fold_base(model, start)


def _filled(model: nn.Module, path: Path) -> nn.Module:
    """A meta-device ``model`` given its weights from the checkpoint at ``path`` on the CPU, whole."""
    materialize(model, real_tensors(model), module_names(model), WeightMap(model, SafetensorsCheckpoint(path)),
                torch.device("cpu"))
    return model.eval()  # as from_pretrained returns it


def empty_model(cls, hf_config, dtype: torch.dtype) -> nn.Module:
    """``cls`` with parameters on the meta device and buffers computed on the CPU, embeddings tied as the config
    says (``from_pretrained`` ties after loading; ``_from_config`` does not)."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        model = cls._from_config(hf_config, dtype=dtype, attn_implementation="sdpa")
    model.tie_weights()
    return model


def lora_config(cfg: Config, model: nn.Module) -> LoraConfig:
    """peft's config for ``lora.*`` on ``model`` (targets checked against it: :func:`_lora_targets`)."""
    lc = cfg.lora
    names = [n for n, _ in model.named_parameters()]
    for t in lc.target_parameters:  # peft passes over a target parameter that matches nothing
        if not any(n == t or n.endswith("." + t) for n in names):
            raise ValueError(f"lora.target_parameters: {t!r} matches no parameter of this "
                             f"{model.config.model_type} model (routed experts: mlp.experts.gate_up_proj, "
                             "mlp.experts.down_proj)")
    return LoraConfig(r=lc.r, lora_alpha=lc.alpha, lora_dropout=lc.dropout, target_modules=_lora_targets(model, cfg),
                      target_parameters=list(lc.target_parameters) or None,
                      init_lora_weights=lc.init_lora_weights, modules_to_save=lc.modules_to_save, bias=lc.bias,
                      use_rslora=lc.use_rslora)


def _renamed_by_peft(model: nn.Module, names: list[str]) -> list[str]:
    """The target_modules peft would rewrite for this model type. peft 0.21 converts targets of some MoE model types
    (qwen3_next: those of Qwen2-MoE) from transformers v4 names: ``gate_proj``/``up_proj``/``down_proj`` become the
    routed experts' stacked parameters and ``gate`` the router's weight, and the dense and shared-expert MLPs they
    name lose their adapters. It does the same when the adapter is loaded, so training must see what loading sees."""
    try:
        from peft.utils.transformers_weight_conversion import convert_peft_config_for_transformers
    except ImportError:  # a peft without the conversion renames nothing
        return []
    renamed = []
    for name in names:
        probe = LoraConfig(target_modules=[name])
        try:
            convert_peft_config_for_transformers(probe, model, None)
        except ValueError:  # half of a fused pair (gate_proj without up_proj): renamed as well
            renamed.append(name)
            continue
        if name not in (probe.target_modules or ()):
            renamed.append(name)
    return renamed


def _lora_targets(model: nn.Module, cfg: Config) -> list[str]:
    """``lora.target_modules``, refused where peft would silently retarget them (see :func:`_renamed_by_peft`); the
    default list leaves those names out on such a model (the header prints what is adapted)."""
    names = list(cfg.lora.target_modules)
    renamed = _renamed_by_peft(model, names)
    if not renamed:
        return names
    if names == type(cfg.lora)().target_modules:
        return [n for n in names if n not in renamed]
    model_type = model.config.model_type
    raise ValueError(f"lora.target_modules: {', '.join(renamed)} on {model_type}: peft reads these names as the "
                     "routed experts / router of this model type (its transformers v4 checkpoint conversion) and would "
                     "drop the dense and shared-expert MLPs; adapt the experts with lora.target_parameters "
                     "(mlp.experts.gate_up_proj, mlp.experts.down_proj) and leave these names out")


def apply_lora(model: nn.Module, cfg: Config) -> nn.Module:
    """LoRA via peft, initialised from ``train.seed``; adapter weights in float32 (peft's autocast) whatever the
    base dtype, computing in the base's dtype (:mod:`packtrain.models.lora_compute`).

    ``enable_input_require_grads`` marks the frozen embedding's output as requiring grad, so checkpointed layers
    see an input that needs gradients (without it a run trains with grad_norm exactly 0 on every step).
    """
    init = cfg.lora.init_lora_weights
    if isinstance(init, str) and init.startswith(DATA_DEPENDENT_INITS) and any(p.is_meta for p in model.parameters()):
        raise ValueError(f"lora.init_lora_weights: {init!r} computes the adapter from the base weights, which "
                         "model.path loads only after wrapping (sharded); use true, false or 'gaussian'")
    # get_peft_model draws lora_A (and lora_B when init_lora_weights is False) from torch's global RNG, which
    # nothing else seeds when the base comes from model.path: seed it from the config, the same on every rank, so
    # one config gives one adapter whatever the base's source and the number of ranks (FSDP shards that init).
    torch.manual_seed(cfg.train.seed)
    try:
        with adapters_on_cpu(model):
            model = get_peft_model(model, lora_config(cfg, model), autocast_adapter_dtype=True)
    except ValueError as e:
        raise ValueError(f"lora: {e}") from None
    lora_compute.install(model)
    router = [n for n, p in model.named_parameters() if p.requires_grad and f".{ROUTER}." in n]
    if router:
        # Without the router's auxiliary balance loss (never added: docs/families.md) a trained router drifts
        # towards a few experts; the experts and the shared expert carry the adaptation instead.
        raise ValueError(f"lora: the MoE router ({ROUTER}) stays frozen, but {router[0]} would train; remove it "
                         "from lora.target_modules / target_parameters / modules_to_save")
    model.enable_input_require_grads()
    return model


DATA_DEPENDENT_INITS = ("pissa", "corda", "olora", "loftq", "eva", "lora_ga")


class adapters_on_cpu:  # a context manager, named like torch.no_grad
    """peft creates each adapter on the CPU, seeded, then moves it to its base layer's device: for a base on the
    meta device that would throw the values away. So while peft runs, each meta parameter is stood in for by a
    CPU tensor of its shape that holds one element (a broadcast view), and put back after. peft's trainable copies
    (``modules_to_save``) made of stand-ins go to the meta device (the loader fills them) at exit, or at
    :meth:`drop_copies`, after which an adapter state dict can be loaded into them."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.originals: dict[int, nn.Parameter] = {}
        self.copies_dropped = False

    def __enter__(self):
        stand_ins: dict[int, nn.Parameter] = {}
        for module in self.model.modules():
            for name, p in module._parameters.items():
                if p is None or not p.is_meta:
                    continue
                if id(p) not in stand_ins:
                    stand_in = nn.Parameter(torch.empty((), dtype=p.dtype).expand(p.shape), p.requires_grad)
                    stand_ins[id(p)], self.originals[id(stand_in)] = stand_in, p
                module._parameters[name] = stand_ins[id(p)]
        return self

    def drop_copies(self) -> None:
        if self.copies_dropped or not self.originals:
            return
        self.copies_dropped = True
        for wrapper in self.model.modules():
            copies = getattr(wrapper, "modules_to_save", None)
            if not isinstance(copies, nn.ModuleDict):
                continue
            for module in [m for c in copies.values() for m in c.modules()]:
                for name, p in module._parameters.items():
                    if p is not None and id(p) not in self.originals:
                        module._parameters[name] = nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)

    def __exit__(self, *exc) -> None:
        self.drop_copies()
        for module in self.model.modules():
            for name, p in module._parameters.items():
                if p is not None and id(p) in self.originals:
                    original = self.originals[id(p)]
                    original.requires_grad_(p.requires_grad)
                    module._parameters[name] = original
