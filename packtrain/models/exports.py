"""Exports of a run's adapter for the places users serve it, in the base checkpoint's own layout.

- ``--merged DIR``: a copy of the base checkpoint where every tensor the adapter touches is replaced: W + scale * B @
  A for a LoRA target (peft's ``get_delta_weight`` on the factors in their own dtype, float32 at least; added in
  float32 or wider and cast back to the checkpoint's dtype), the trained copy for a ``modules_to_save`` module.
- ``--for vllm DIR`` / ``--for sglang DIR``: ``DIR/adapter``, the LoRA part alone in peft's format with the module
  names of the checkpoint it is served on, and ``DIR/model``, that checkpoint with the trained ``modules_to_save``
  folded in (the servers refuse or drop them in an adapter: :mod:`packtrain.models.serving`); unchanged without
  them.
- A run that started from a trained adapter (``model.adapter``) trained on the base with that adapter folded in:
  both exports fold it (and the starts its record names) into the base first, by the same arithmetic
  (:mod:`packtrain.models.start_adapter`).

The base's shard files, key names and index are kept, so serving engines that read the original read the export;
every shard without a changed tensor is copied byte for byte, and in the others every unchanged tensor keeps its
bytes (the tensors the model class does not load, ``mtp.*``, included). Every export carries the run's tokenizer and
the chat template it trained with (``data.chat_template`` where set, in place of the tokenizer's own), the image
processor for a vision-language model only, and the base's config and generation config. Every file gets the mode
a new file gets here (peft writes its weights 0600, which another user's server cannot read). Memory: one shard at a
time plus the adapter; the base model is only ever built on the meta device, to learn its parameter names.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from packtrain.config.typed import read_json_object
from packtrain.data.images import PROCESSOR_FILES
from packtrain.data.jsonl import TOKENIZER_FILES
from packtrain.models import serving
from packtrain.models.loading import INDEX_FILE, SafetensorsCheckpoint, WeightMap, module_names, read_adapter
from packtrain.models.start_adapter import Fold, StartAdapter, factor_dtype, merged, module_path, other_layout

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")


@dataclass(frozen=True)
class RunFiles:
    """What an export carries beside the weights: the folder of the tokenizer the run read, the chat template it
    trained with (None: the tokenizer's own) and, for a vision-language model, the image processor's folder."""
    tokenizer: Path | None
    chat_template: str | None = None
    processor: Path | None = None


def new_file_mode() -> int:
    """The mode a file created here gets: 0o666 less the process's umask (read without changing it)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def plain_modes(folder: Path) -> None:
    """Every file under ``folder`` to :func:`new_file_mode` (peft writes adapter weights 0600)."""
    mode = new_file_mode()
    for path in Path(folder).rglob("*"):
        if path.is_file() and not path.is_symlink():
            path.chmod(mode)


# the adapter config's entries that may name a module by its whole path
_MODULE_PATTERNS = ("rank_pattern", "alpha_pattern")


def _config_in_layout(config: dict, moved: dict[str, str]) -> dict:
    """The adapter config with every module named by its whole path in the other layout (``moved``: old path ->
    new) renamed, in ``target_modules`` (a list) and the keys of ``rank_pattern`` and ``alpha_pattern``: left as they
    were, peft would target nothing there, or give the module the default rank (a shape error on load)."""
    out = dict(config)
    if isinstance(config.get("target_modules"), list):
        out["target_modules"] = [moved.get(m, m) for m in config["target_modules"]]
    for key in _MODULE_PATTERNS:
        if isinstance(config.get(key), dict):
            out[key] = {moved.get(m, m): v for m, v in config[key].items()}
    return out


def _peft_model(base: nn.Module, tensors: dict, where: Path, config: dict) -> nn.Module:
    """The adapter of ``where`` (``config``: its config, in the base's layout; ``tensors``, its weights) on the
    meta-device base (adapter weights real, on the CPU), as peft would load it."""
    from peft import LoraConfig, PeftConfig, get_peft_model, set_peft_model_state_dict

    from packtrain.models.build import adapters_on_cpu

    peft_config = PeftConfig.from_pretrained(str(where))
    if not isinstance(peft_config, LoraConfig):
        raise ValueError(f"--adapter: {where} holds a {type(peft_config).__name__}, only LoRA exports")
    if peft_config.use_dora or peft_config.lora_bias:
        raise ValueError(f"--adapter: {where} uses DoRA or LoRA biases, which these exports do not support")
    if isinstance(config.get("target_modules"), list):
        peft_config.target_modules = set(config["target_modules"])
    for key in _MODULE_PATTERNS:
        if isinstance(config.get(key), dict):
            setattr(peft_config, key, dict(config[key]))
    peft_config.inference_mode = True
    with adapters_on_cpu(base) as cpu:  # peft would move the loaded adapter to the base's (meta) device too
        model = get_peft_model(base, peft_config, autocast_adapter_dtype=True)
        cpu.drop_copies()  # modules_to_save copies: meta, then assigned the trained tensors
        result = set_peft_model_state_dict(model, tensors, low_cpu_mem_usage=True)
    missing = [k for k in result.missing_keys if "lora_" in k or "modules_to_save" in k]
    if missing:
        raise ValueError(f"--adapter: {where} lacks {len(missing)} adapter tensors, e.g. {missing[0]}")
    return model


def _factor_dtype(tensors: dict) -> torch.dtype:
    """The dtype the adapter's LoRA factors merge in: theirs, float32 at least (peft's autocast), so a float64 run's
    factors are not rounded to float32 (peft casts them to the base layer's dtype: the meta base is built in it).
    A run started from an adapter folds it by the same arithmetic (:class:`packtrain.models.start_adapter.Lora`)."""
    return factor_dtype(t.dtype for k, t in tensors.items() if ".lora_" in k)


@torch.no_grad()
def adapter_changes(model: nn.Module, names: dict[nn.Module, str]):
    """(model parameter name -> a function giving the LoRA delta, name -> the trained modules_to_save tensor)."""
    from peft.tuners.lora import LoraLayer

    deltas, replaced = {}, {}
    for module in model.modules():
        if isinstance(module, LoraLayer) and module.active_adapters:
            base_layer = module.get_base_layer()
            for adapter in module.active_adapters:
                if adapter in module.lora_A or adapter in module.lora_embedding_A:
                    deltas[f"{names[base_layer]}.weight"] = lambda m=module, a=adapter: m.get_delta_weight(a)
        copies = getattr(module, "modules_to_save", None)
        original = getattr(module, "original_module", None)
        if isinstance(copies, nn.ModuleDict) and original is not None:
            trained = copies[module.active_adapters[0]]
            for (name, p), (_, orig) in zip(trained.named_parameters(), original.named_parameters()):
                replaced[f"{names[original]}.{name}"] = p.detach()
    return deltas, replaced


class _Base:
    """The base checkpoint as an export reads it: its config, model class on the meta device, module names and
    where each parameter is stored; and the run's start adapter (``model.adapter``), folded into every tensor it
    changes before the run's own adapter."""

    def __init__(self, base_dir: Path, start: StartAdapter | None = None, dtype: torch.dtype = torch.float32):
        """``dtype``: the meta model's, which peft casts the adapter's factors to (:func:`_factor_dtype`)."""
        from transformers import AutoConfig

        from packtrain.models.build import empty_model, model_class_for

        self.dir = base_dir
        self.config = AutoConfig.from_pretrained(base_dir, local_files_only=True)
        self.vision_language = getattr(self.config, "vision_config", None) is not None
        self.model = empty_model(model_class_for(self.config.model_type), self.config, dtype)
        self.names = module_names(self.model)
        self.checkpoint = SafetensorsCheckpoint(base_dir)
        self.weights = WeightMap(self.model, self.checkpoint)
        self.fold = Fold(start.links, self.model) if start is not None else None
        for name in self.fold.changes if self.fold else ():
            self._stored_alone(name, "the run's model.adapter")

    def adapter(self, adapter_dir: Path, tensors: dict, log) -> tuple[dict, dict, nn.Module]:
        """The adapter's config, its ``tensors`` named as this checkpoint names its modules (an adapter trained on
        the text class and served on the vision-language checkpoint, or the reverse, is renamed), and the peft model
        they make on this base."""
        config = read_json_object(adapter_dir / ADAPTER_CONFIG, "--adapter")
        names = self._stored_names(tensors)
        renamed = {names[k]: v for k, v in tensors.items()}
        moved = {module_path(k): module_path(v) for k, v in names.items() if k != v}
        if moved:
            layout = "vision-language" if self.vision_language else "text"
            log(f"packtrain export: the adapter's module names put in the {layout} layout of {self.dir}")
            config = _config_in_layout(config, moved)
        return config, renamed, _peft_model(self.model, renamed, adapter_dir, config)

    def _stored_names(self, keys) -> dict[str, str]:
        """Each adapter key -> the same key naming its module as this checkpoint stores it (what a server reads:
        vLLM applies nothing of a text-layout adapter on the vision-language class, and peft loads nothing of it)."""
        stored = set(self.checkpoint.keys())
        stored |= {k[:i] for k in stored for i, c in enumerate(k) if c == "."}  # every module path
        out = {}
        for key in keys:
            path = module_path(key)
            if path in stored:
                out[key] = key
                continue
            other = other_layout(path)
            if other is None or other not in stored:
                raise ValueError(f"--adapter: its module {path} is not a module of the checkpoint {self.dir}"
                                 f"{f' (nor {other})' if other else ''}: an adapter of another model?")
            out[key] = key.replace(path, other, 1)
        return out

    def changes(self, model: nn.Module, lora: bool) -> tuple[dict, dict]:
        deltas, replaced = adapter_changes(model, self.names)
        deltas = deltas if lora else {}
        for name in [*deltas, *replaced]:
            self._stored_alone(name, "the adapter")
        return deltas, replaced

    def _stored_alone(self, name: str, what: str) -> None:
        if name not in self.weights.direct:
            raise ValueError(f"{self.dir}: {what} changes {name}, which the checkpoint does not store as one tensor "
                             "of its own (tied or converted); cannot write it in the checkpoint's layout")

    def write(self, tmp: Path, deltas: dict, replaced: dict, log) -> dict:
        """The checkpoint's shards into ``tmp`` with the changes applied; counts for the report."""
        from safetensors import safe_open
        from safetensors.torch import save_file

        source_of = {ckpt_key: name for name, ckpt_key in self.weights.direct.items()}
        folded = self.fold.changes if self.fold is not None else {}
        shards = self.checkpoint.files()
        changed = copied = 0
        for i, shard in enumerate(shards, 1):
            keys = [k for k, f in self.checkpoint.file_of.items() if f == shard]
            if not any(source_of.get(k) in deltas or source_of.get(k) in replaced or source_of.get(k) in folded
                       for k in keys):
                shutil.copyfile(shard, tmp / shard.name)  # nothing changes in this shard: byte for byte
                copied += 1
            else:
                with safe_open(str(shard), framework="pt") as f:
                    metadata = f.metadata()
                    tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - a safetensors handle
                for key, w in tensors.items():
                    name = source_of.get(key)
                    if name in folded:  # the start first: the run's adapter trained on top of it
                        w = tensors[key] = self.fold.apply(name, w).contiguous()
                        changed += name not in deltas and name not in replaced
                    if name in deltas:
                        tensors[key] = merged(w, deltas[name]())
                        changed += 1
                    elif name in replaced:
                        new = replaced[name]
                        if new.shape != w.shape:
                            raise ValueError(f"{shard.name}: {key} has shape {tuple(w.shape)}, the trained module "
                                             f"{tuple(new.shape)}")
                        tensors[key] = new.to(w.dtype).contiguous()
                        changed += 1
                save_file(tensors, str(tmp / shard.name), metadata=metadata)
                del tensors
            if len(shards) > 4:
                log(f"packtrain export: shard {i}/{len(shards)} {shard.name}")
        index = self.dir / INDEX_FILE
        data = json.loads(index.read_text()) if index.is_file() else {"metadata": {}}
        data["weight_map"] = {k: f.name for k, f in self.checkpoint.file_of.items()}
        data.setdefault("metadata", {})["total_size"] = sum((tmp / f.name).stat().st_size for f in shards)
        (tmp / INDEX_FILE).write_text(json.dumps(data, indent=2) + "\n")
        return {"changed_tensors": changed, "shards": len(shards), "shards_copied_unchanged": copied,
                "carried_over_not_loaded": len(self.weights.extra)}

    def side_files(self, tmp: Path, run: RunFiles) -> list[str]:
        """The base's files that are not weights (config, generation config, ...), then the run's tokenizer and chat
        template (replacing the base's), and the image processor for a vision-language model only."""
        tokenizer_names = set(TOKENIZER_FILES) | set(TEMPLATE_FILES)
        leave = tokenizer_names | (set() if self.vision_language else set(PROCESSOR_FILES))
        copied = []
        for f in sorted(self.dir.iterdir()):
            if f.is_file() and not f.name.endswith(".safetensors") and f.name != INDEX_FILE and f.name not in leave:
                shutil.copyfile(f, tmp / f.name)
                copied.append(f.name)
        folders = [run.tokenizer or self.dir] + ([run.processor or self.dir] if self.vision_language else [])
        for folder, names in zip(folders, [tokenizer_names, PROCESSOR_FILES]):
            for name in sorted(names):  # one order on every run (a set's follows the hash seed)
                if (folder / name).is_file() and not (tmp / name).exists():
                    shutil.copyfile(folder / name, tmp / name)
                    copied.append(name)
        extra = (run.tokenizer or self.dir) / "additional_chat_templates"
        if extra.is_dir() and run.chat_template is None:
            shutil.copytree(extra, tmp / extra.name)
            copied.append(extra.name + "/")
        if run.chat_template is not None:
            use_template(tmp, run.chat_template)
            copied = [name for name in copied if (tmp / name.rstrip("/")).exists()]  # the replaced template is gone
            if "chat_template.jinja" not in copied:
                copied.append("chat_template.jinja")
        return copied


def use_template(folder: Path, template: str) -> None:
    """``template`` as the tokenizer's only chat template in ``folder``: chat_template.jinja, no chat_template.json,
    no ``chat_template`` in tokenizer_config.json (transformers would read one of those otherwise)."""
    (folder / "chat_template.jinja").write_text(template)
    (folder / "chat_template.json").unlink(missing_ok=True)
    config = folder / "tokenizer_config.json"
    if config.is_file():
        data = json.loads(config.read_text())
        if "chat_template" in data:
            del data["chat_template"]
            config.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


@contextlib.contextmanager
def _staged(out: Path, flag: str):
    """A folder beside ``out`` (which must not exist) to write the export into, renamed to ``out`` when the block
    ends and removed when it raises (a refusal or an error leaves nothing behind)."""
    if out.exists():
        raise ValueError(f"{flag}: {out} already exists (choose a new directory)")
    tmp = out.parent / f".tmp-{out.name}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    plain_modes(tmp)
    tmp.rename(out)


def export_merged(base_dir: Path, adapter_dir: Path, out: Path, run: RunFiles, log=print,
                  start: StartAdapter | None = None) -> dict:
    """The merged checkpoint in ``out`` (which must not exist); returns counts for the report. ``start``: the run's
    ``model.adapter``, merged in first."""
    tensors = read_adapter(adapter_dir)
    base = _Base(base_dir, start, _factor_dtype(tensors))
    _, _, model = base.adapter(adapter_dir, tensors, log)
    deltas, replaced = base.changes(model, lora=True)
    with _staged(out, "--merged") as tmp:
        report = base.write(tmp, deltas, replaced, log)
        report["files"] = base.side_files(tmp, run)
    log(f"packtrain export: {out}: {report['changed_tensors']} tensors merged, {report['shards']} shards "
        f"({report['shards_copied_unchanged']} copied unchanged), {report['carried_over_not_loaded']} tensors the "
        f"model class does not load carried over ({base.weights.extra_summary() or 'none'}); copied "
        f"{', '.join(report['files']) or 'no other files'}")
    return report


def export_for(server: str, base_dir: Path, adapter_dir: Path, out: Path, run: RunFiles, name: str,
               version: str | None = None, log=print, start: StartAdapter | None = None) -> dict:
    """``out/adapter`` and ``out/model`` for ``server`` (vllm, sglang), refused naming each module the server
    cannot apply; prints the lines that serve them. ``start``: the run's ``model.adapter``, folded into
    ``out/model``."""
    tensors = read_adapter(adapter_dir)
    base = _Base(base_dir, start, _factor_dtype(tensors))
    config, tensors, model = base.adapter(adapter_dir, tensors, log)
    modules = serving.AdapterModules.of_keys(tensors, config.get("modules_to_save"))
    verdict = serving.verdict(server, modules, version)
    if not verdict.serves:
        raise ValueError(f"--for {server}: {verdict.refusal()}. Alternatives: --merged DIR (the adapter merged into "
                         f"the checkpoint, which every engine serves), or train with lora.target_modules that "
                         f"{server} applies")
    ranks = [config.get("r", 8), *(config.get("rank_pattern") or {}).values()]
    lines = _serve_lines(server, out, name, ranks, verdict, sorted(modules.lora))  # a rank vLLM refuses: before
    _, replaced = base.changes(model, lora=False)
    with _staged(out, "--for") as tmp:
        (tmp / "model").mkdir()
        report = base.write(tmp / "model", {}, replaced, log)
        report["files"] = base.side_files(tmp / "model", run)
        # the LoRA part alone: the servers refuse (vLLM) or drop (SGLang) modules_to_save in an adapter
        lora = {k: v for k, v in tensors.items() if ".lora_" in k}
        adapter_config = {**config, "modules_to_save": None, "inference_mode": True,
                          "base_model_name_or_path": str(out.resolve() / "model")}
        (tmp / "adapter").mkdir()
        from safetensors.torch import save_file

        save_file(lora, str(tmp / "adapter" / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        (tmp / "adapter" / ADAPTER_CONFIG).write_text(json.dumps(adapter_config, indent=2, sort_keys=True) + "\n")
    folded = f", {', '.join(verdict.folded)} folded into {out / 'model'}" if verdict.folded else ""
    log(f"packtrain export: {out / 'adapter'}: {len(lora)} LoRA tensors ({', '.join(sorted(modules.lora))}){folded}; "
        f"{out / 'model'}: {report['shards']} shards ({report['shards_copied_unchanged']} copied unchanged), "
        f"{', '.join(report['files'])}")
    for line in lines:
        log(line)
    return {**report, "lora_tensors": len(lora), "folded": list(verdict.folded), "serve": lines}


def _serve_lines(server: str, out: Path, name: str, ranks: list[int], verdict: serving.Verdict,
                 modules: list[str]) -> list[str]:
    model, adapter = out.resolve() / "model", out.resolve() / "adapter"
    if server == "vllm":
        rank = serving.vllm_lora_rank(ranks)
        flags = "".join(f" {f}" for f in verdict.flags)
        request = ", is_3d_lora_weight=True" if verdict.flags else ""
        mixed = ", enable_mixed_moe_lora_format=True" if verdict.flags else ""
        command = (f"serve it: vllm serve {model} --enable-lora --max-lora-rank {rank} --lora-modules "
                   f"{name}={adapter}{flags}")
        python = (f"or in Python: LLM(model={str(model)!r}, enable_lora=True, max_lora_rank={rank}{mixed}).generate("
                  f"..., lora_request=LoRARequest({name!r}, 1, {str(adapter)!r}{request}))")
        return [command, python]
    targets = " ".join(sorted(set(modules)))
    return [(f"serve it: python -m sglang.launch_server --model-path {model} --enable-lora --lora-paths "
             f"{name}={adapter} --max-lora-rank {max(ranks)} --lora-target-modules {targets}")]


def adapter_name(output_dir: Path) -> str:
    """The name the serve lines give the adapter: the run directory's, in the characters servers take."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", Path(output_dir).resolve().name).strip("-") or "packtrain"
