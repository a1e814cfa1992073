"""``model.adapter: DIR``: a trained PEFT adapter as the run's starting point, folded into the base.

The model a run trains on is the base with the adapter merged in, what ``packtrain export --merged`` writes, by the
same arithmetic (:func:`merged`): each LoRA target W + scaling * B @ A (added in float32 or wider, cast back), each
``modules_to_save`` tensor replaced by the trained one. The run's own LoRA goes on top, so DPO's reference (that
LoRA disabled) is the start's model.

- A base built from ``model.config`` is folded in place after the build, after ``OUTPUT/base`` is written (which
  stays the random init: the base the chain starts from).
- A base read from ``model.path`` is folded while it is read (:class:`Fold` on the loader's
  :class:`~packtrain.models.loading.WeightMap`): each rank folds the rows and columns it reads, W[r, c] + scaling *
  B[r] @ A[:, c], and holds no more than its shards.
- The exports fold it into the base checkpoint's tensors before the run's own adapter (:mod:`packtrain.models.exports`).

Which base an adapter belongs to: every adapter packtrain writes has :data:`RECORD` beside its PEFT files: the
identities of the base it trained on (``model.config`` with its seed; a checkpoint directory's config and sampled
weight files, ``OUTPUT/base`` included, so either form of one base matches) and the start it was folded onto (its
directory and a digest of its files). Folding follows those records down the chain (SFT -> DPO -> RL: base + SFT +
DPO), refusing a link whose files changed since. An adapter without a record (another tool's) is checked against its
``base_model_name_or_path`` where that is a local directory, else by its tensors' shapes alone.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from packtrain.config import Config
from packtrain.config.typed import read_json_object

RECORD = "packtrain_base.json"  # beside the PEFT files of every adapter packtrain writes
CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
FOLD_ATTR = "packtrain_fold"  # on a meta-device base: the fold its loader applies (loading.WeightMap)
FLAG = "model.adapter"

# adapter_config.json keys of what a fold cannot express as W + scaling * B @ A or a replaced tensor
UNFOLDED = {"use_dora": "DoRA", "lora_bias": "LoRA biases", "target_parameters": "targeted parameters",
            "trainable_token_indices": "trained token rows", "layer_replication": "replicated layers",
            "alora_invocation_tokens": "activated LoRA"}


# -- the one merge arithmetic (the exports' too) -------------------------------------------------------------------

def merged(w: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """``w + delta``, added in the wider of the two dtypes (float32 at least) and cast back to ``w``'s dtype once: a
    float64 delta on a float32 checkpoint is not rounded to float32 before the sum."""
    wide = torch.promote_types(torch.promote_types(w.dtype, delta.dtype), torch.float32)
    return (w.to(wide) + delta.to(wide)).to(w.dtype)


def factor_dtype(dtypes) -> torch.dtype:
    """The dtype LoRA factors of ``dtypes`` compute their delta in: their own, float32 at least."""
    wide = torch.float32
    for dtype in dtypes:
        wide = torch.promote_types(wide, dtype)
    return wide


# The two layouts of Qwen3.5's language model: the text class's and the vision-language class's. A checkpoint stores its
# class's; peft writes an adapter's keys in the text layout whichever class it trained (its transformers-v4 key
# conversion), and reads them back either way, where vLLM reads them as they are.
TEXT_PREFIX, VL_PREFIX = "model.", "model.language_model."
_LANGUAGE_PARTS = ("layers.", "embed_tokens.", "norm.")
PEFT_PREFIX = "base_model.model."


def other_layout(path: str) -> str | None:
    """A module path of one layout in the other (None: the same in both, the head say)."""
    if path.startswith(VL_PREFIX):
        return TEXT_PREFIX + path[len(VL_PREFIX):]
    if path.startswith(TEXT_PREFIX) and path[len(TEXT_PREFIX):].startswith(_LANGUAGE_PARTS):
        return VL_PREFIX + path[len(TEXT_PREFIX):]
    return None


def module_path(key: str) -> str:
    """``base_model.model.<module>.lora_A.weight`` -> ``<module>`` (a routed-expert stack: peft's wrapper chain of
    ``base_layer`` dropped); a trained module's tensor (``base_model.model.lm_head.weight``) -> its name."""
    path = key.removeprefix(PEFT_PREFIX)
    path = path.split(".lora_")[0]
    while path.endswith(".base_layer"):
        path = path[: -len(".base_layer")]
    return path


# -- which base ----------------------------------------------------------------------------------------------------

WEIGHT_SAMPLES = 8  # pieces of 64 KiB read from each weight file for a checkpoint's digest, spread over the file
_PIECE = 1 << 16


def sampled_bytes(file: Path) -> bytes:
    """:data:`WEIGHT_SAMPLES` pieces of ``file``, spread over it (a checkpoint of 54 GB is not read whole)."""
    size = file.stat().st_size
    out = bytearray()
    with file.open("rb") as f:
        for k in range(WEIGHT_SAMPLES):
            f.seek(max(0, (size - _PIECE) * k // max(WEIGHT_SAMPLES - 1, 1)))
            out += f.read(_PIECE)
    return bytes(out)


def feed_checkpoint(h, folder: Path) -> None:
    """A checkpoint directory into the hash ``h``: its config.json, and its weight files' names, sizes and sampled
    pieces."""
    for file in sorted(Path(folder).iterdir()):
        if file.name == "config.json":
            h.update(file.read_bytes())
        elif file.suffix in (".safetensors", ".bin", ".pt"):
            h.update(f"{file.name}:{file.stat().st_size}".encode())
            h.update(sampled_bytes(file))


def checkpoint_identity(folder: Path) -> str:
    h = hashlib.sha256(b"checkpoint")
    feed_checkpoint(h, folder)
    return h.hexdigest()[:16]


def config_identity(model_config: dict, seed: int) -> str:
    """A random base: ``model.config`` and ``model.seed`` (not the dtype: each dtype's init is one float32 init
    cast)."""
    return hashlib.sha256(b"config" + json.dumps(model_config, sort_keys=True).encode()
                          + repr(seed).encode()).hexdigest()[:16]


def base_identities(cfg: Config, saved_base: Path | None = None) -> list[str]:
    """The config's base, each form it has: ``model.config`` with its seed (and ``saved_base``, OUTPUT/base, once
    written), or ``model.path``'s checkpoint."""
    if cfg.model.config is not None:
        ids = [config_identity(cfg.model.config, cfg.model.seed)]
        if saved_base is not None and (Path(saved_base) / "config.json").is_file():
            ids.append(checkpoint_identity(Path(saved_base)))
        return ids
    return [checkpoint_identity(cfg.resolve_path(cfg.model.path))]


def describe_base(cfg: Config) -> str:
    if cfg.model.config is not None:
        return f"model.config ({cfg.model.config.get('model_type')}, seed {cfg.model.seed})"
    return f"model.path {cfg.resolve_path(cfg.model.path)}"


def adapter_digest(folder: Path) -> str:
    """An adapter directory's config, weights and record, read whole (the record pins the chain below it)."""
    h = hashlib.sha256()
    for name in (CONFIG, WEIGHTS, RECORD):
        path = Path(folder) / name
        if path.is_file():
            h.update(f"{name}:{path.stat().st_size}:".encode())
            with path.open("rb") as f:
                for block in iter(lambda: f.read(1 << 24), b""):
                    h.update(block)
    return h.hexdigest()[:16]


# -- one adapter of the chain ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Lora:
    """One LoRA target's factors: its delta is ``scaling * B @ A``, transposed for an embedding (or a
    ``fan_in_fan_out`` layer), as peft's ``get_delta_weight`` computes it on factors of :func:`factor_dtype` (the
    export's peft model holds them in that dtype)."""
    key: str  # lora_A's key in the file, for messages
    a: torch.Tensor
    b: torch.Tensor
    scaling: float
    transposed: bool

    @property
    def shape(self) -> tuple[int, int]:
        out, into = self.b.shape[0], self.a.shape[1]
        return (into, out) if self.transposed else (out, into)

    def delta(self, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """The delta, or only ``index`` of it (rows, columns): B[rows] @ A[:, columns], in the factors' dtype, float32
        at least (where peft's autocast puts them)."""
        rows, cols = (tuple(index or ()) + (slice(None), slice(None)))[:2]
        if self.transposed:
            rows, cols = cols, rows
        wide = factor_dtype([self.a.dtype])
        out = self.b[rows].to(wide) @ self.a[:, cols].to(wide)
        return (out.T if self.transposed else out) * self.scaling

    def apply(self, t: torch.Tensor, index=None) -> torch.Tensor:
        return merged(t, self.delta(index))


@dataclass(frozen=True)
class Saved:
    """A ``modules_to_save`` tensor: it replaces the base's, read from the adapter's file slice by slice."""
    key: str
    file: Path
    shape: tuple[int, ...]

    def apply(self, t: torch.Tensor, index=None) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(self.file), framework="pt") as f:
            new = f.get_slice(self.key)[index] if index else f.get_tensor(self.key)
        return new.to(t.dtype).contiguous()


@dataclass
class Link:
    dir: Path
    config: dict
    record: dict | None  # RECORD, None: an adapter another tool wrote
    changes: dict[str, Lora | Saved]  # module path (LoRA) or parameter path (saved) as the adapter names it


_LORA_KEY = re.compile(r"^(?P<path>.+?)\.(?P<part>lora_A\.weight|lora_B\.weight|lora_embedding_A|lora_embedding_B)$")


def read_link(folder: Path, flag: str = FLAG) -> Link:
    """One adapter directory, checked: its config says plain LoRA (+ modules_to_save), every tensor of its file is a
    LoRA factor (paired, of the configured rank) or a trained module's."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"{flag}: {folder} does not exist (a PEFT adapter directory)")
    for name in (CONFIG, WEIGHTS):
        if not (folder / name).is_file():
            raise ValueError(f"{flag}: {folder} is not a PEFT adapter directory (no {name})")
    config = read_json_object(folder / CONFIG, flag)
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{flag}: {folder} holds a {config['peft_type']} adapter; only LoRA is folded")
    for key, what in UNFOLDED.items():
        if config.get(key):
            raise ValueError(f"{flag}: {folder / CONFIG}: {key} {config[key]!r} ({what}) is not folded; only plain "
                             "LoRA and modules_to_save are")
    if config.get("bias", "none") != "none":
        raise ValueError(f"{flag}: {folder / CONFIG}: bias {config['bias']!r} (trained biases) is not folded")
    written = read_json_object(folder / RECORD, flag) if (folder / RECORD).is_file() else None
    return Link(folder, config, written, _changes(folder, config, flag))


def _changes(folder: Path, config: dict, flag: str) -> dict[str, Lora | Saved]:
    from safetensors import safe_open

    path = folder / WEIGHTS
    factors, saved = {}, {}
    keep = [str(m) for m in config.get("modules_to_save") or ()]
    try:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - a safetensors handle
                m = _LORA_KEY.match(key)
                if m:
                    factors.setdefault(module_path(key), {})[m["part"].split(".")[0][-1]] = (key, f.get_tensor(key))
                    continue
                param = key.removeprefix(PEFT_PREFIX)
                module = param.rsplit(".", 1)[0]
                if ".base_layer." in param and ".lora_" not in param:  # an embedding peft saved whole: it replaces
                    param = param.replace(".base_layer.", ".")  # the base's (peft loads it so)
                elif ".lora_" in key or not any(module == k or module.endswith("." + k) for k in keep):
                    raise ValueError(f"{flag}: {path}: {key} is neither a LoRA factor nor a tensor of the "
                                     f"modules_to_save {keep}; not folded")
                saved[param] = Saved(key, path, tuple(f.get_slice(key).get_shape()))
    except ValueError:  # the refusal above
        raise
    except Exception as e:  # noqa: BLE001 - safetensors' own error types: any of them means unreadable
        raise ValueError(f"{flag}: {path}: unreadable ({type(e).__name__}: {str(e)[:200]}); a damaged or truncated "
                         "copy?") from None
    changes: dict[str, Lora | Saved] = dict(saved)
    for module, pair in factors.items():
        if set(pair) != {"A", "B"}:
            key = next(iter(pair.values()))[0]
            raise ValueError(f"{flag}: {path}: {key} has no lora_{'B' if 'A' in pair else 'A'} beside it")
        (key, a), (_, b) = pair["A"], pair["B"]
        r, alpha = _pattern(config, "rank_pattern", "r", module), _pattern(config, "alpha_pattern", "lora_alpha",
                                                                             module)
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != r or b.shape[1] != r:
            raise ValueError(f"{flag}: {path}: {key} {tuple(a.shape)} with lora_B {tuple(b.shape)} is not a rank-{r} "
                             "pair of a linear layer or an embedding; not folded")
        scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r  # peft's update_layer
        embedding = "lora_embedding_" in key
        changes[module] = Lora(key, a, b, scaling, embedding or bool(config.get("fan_in_fan_out")))
    return changes


def _pattern(config: dict, patterns: str, default: str, module: str):
    """peft's rank_pattern / alpha_pattern lookup: the first pattern that matches the end of the module's name."""
    for pattern, value in (config.get(patterns) or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return value
    return config.get(default, 8)


# -- the chain ------------------------------------------------------------------------------------------------------

@dataclass
class StartAdapter:
    """``model.adapter`` and the starts its records name, in the order they fold: the deepest first."""
    links: list[Link]
    digest: str  # model.adapter's files (its record pins the chain below)
    base: list[str]  # the base identities its record names ([]: an adapter of another tool)
    note: str | None  # what the user should know: only shapes were checked

    @property
    def top(self) -> Link:
        return self.links[-1]

    def describe(self) -> str:
        chain = " + ".join(str(link.dir) for link in self.links)
        return f"{FLAG}: the base + {chain}, folded into the model this run trains on"


def read_start(cfg: Config) -> StartAdapter | None:
    """``model.adapter``'s chain, read and checked against the config's base; None without one. Every refusal is
    one line naming model.adapter, before any weight loads."""
    if cfg.model.adapter is None:
        return None
    return read_chain(cfg.resolve_path(cfg.model.adapter), base_identities(cfg), describe_base(cfg))


def read_chain(folder: Path, identities: list[str], base_name: str, flag: str = FLAG) -> StartAdapter:
    top = read_link(folder, flag)
    note = check_base(top, identities, base_name, flag)
    links = [top]
    while links[0].record and links[0].record.get("start"):
        start, below = links[0].record["start"], links[0].dir
        path = Path(start["path"])
        if not (path / CONFIG).is_file():
            raise ValueError(f"{flag}: {below} was trained from the start adapter {path}, which is gone")
        digest = adapter_digest(path)
        if digest != start.get("digest"):
            raise ValueError(f"{flag}: {below} was trained from the start adapter {path}, whose files changed since "
                             f"(digest {digest}, recorded {start.get('digest')}): refused")
        links.insert(0, read_link(path, flag))
    base = list(top.record.get("base") or ()) if top.record else []
    return StartAdapter(links, adapter_digest(folder), base, note)


def check_base(link: Link, identities: list[str], base_name: str, flag: str = FLAG) -> str | None:
    """Refuses an adapter of another base; returns a note where its base could not be checked."""
    if link.record is not None:
        recorded = [str(i) for i in link.record.get("base") or ()]
        if set(recorded) & set(identities):
            return None
        raise ValueError(f"{flag}: {link.dir} was trained on another base, {link.record.get('base_name', '?')} "
                         f"({', '.join(recorded) or 'none recorded'}), not this one, {base_name} "
                         f"({', '.join(identities)}): refused")
    named = link.config.get("base_model_name_or_path")
    if isinstance(named, str) and (Path(named) / "config.json").is_file():
        found = checkpoint_identity(Path(named))
        if found in identities:
            return None
        raise ValueError(f"{flag}: {link.dir} was trained on another base, base_model_name_or_path {named} ({found}), "
                         f"not this one, {base_name} ({', '.join(identities)}): refused")
    return (f"{flag}: {link.dir} was written by another tool and names no local base (base_model_name_or_path "
            f"{named!r}): only its tensors' shapes were checked against this model")


def check_trained_adapter(adapter: Path, start: StartAdapter | None, flag: str = "--adapter") -> None:
    """A packtrain adapter trained on top of a start is evaluated on that start alone (and one trained without one,
    without): its record names it."""
    if not (Path(adapter) / RECORD).is_file():
        return
    trained = read_json_object(Path(adapter) / RECORD, flag).get("start") or {}
    if trained.get("digest") != (start.digest if start else None):
        was = f"on top of {trained.get('path')}" if trained else "on the base alone"
        here = f"model.adapter {start.top.dir}" if start else "no model.adapter"
        raise ValueError(f"{flag}: {adapter} was trained {was}; this config has {here}: set model.adapter as the run "
                         "that trained it did")


def record_for(cfg: Config, start: StartAdapter | None, saved_base: Path | None = None) -> dict:
    """:data:`RECORD` of an adapter trained under ``cfg``: its base in each form (a start's too: one base) and its
    start."""
    base = base_identities(cfg, saved_base)
    base += [i for i in (start.base if start else ()) if i not in base]
    return {"base": base, "base_name": describe_base(cfg),
            "start": {"path": str(start.top.dir.resolve()), "digest": start.digest} if start else None}


# -- folding it into a model ----------------------------------------------------------------------------------------

class Fold:
    """The changes of a chain's ``links`` by parameter name of one model, in the chain's order, each checked to land
    on a parameter of that shape; applied to a whole tensor or to (rows, columns) of it."""

    def __init__(self, links: list[Link], model: nn.Module, flag: str = FLAG):
        shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
        holders: dict[int, list[str]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            holders.setdefault(id(p), []).append(name)
        tied = {n: names for names in holders.values() if len(names) > 1 for n in names}
        self.changes: dict[str, list[Lora | Saved]] = {}
        for link in links:
            for path, change in link.changes.items():
                name = _parameter(path if isinstance(change, Saved) else f"{path}.weight", shapes)
                if name is None:
                    raise ValueError(f"{flag}: {link.dir}: {change.key} names {path}, which is no "
                                     f"{'parameter' if isinstance(change, Saved) else 'module'} of this model: an "
                                     "adapter of another model?")
                if tuple(change.shape) != shapes[name]:
                    raise ValueError(f"{flag}: {link.dir}: {change.key} changes {name} as shape {tuple(change.shape)}, "
                                     f"the model's is {shapes[name]}: an adapter of another model?")
                if name in tied:
                    raise ValueError(f"{flag}: {link.dir}: {change.key} changes {name}, which this model ties to "
                                     f"{', '.join(n for n in tied[name] if n != name)}; not folded")
                self.changes.setdefault(name, []).append(change)

    def apply(self, name: str, t: torch.Tensor, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        for change in self.changes.get(name, ()):
            t = change.apply(t, index)
        return t

    @torch.no_grad()
    def fold_in_place(self, model: nn.Module) -> None:
        params = dict(model.named_parameters())
        for name in self.changes:
            params[name].copy_(self.apply(name, params[name].detach()))


def _parameter(path: str, shapes: dict) -> str | None:
    """The model's parameter of an adapter's path, in either layout (:func:`other_layout`)."""
    for candidate in (path, other_layout(path)):
        if candidate in shapes:
            return candidate
    return None


def fold_base(model: nn.Module, start: StartAdapter | None) -> nn.Module:
    """``start`` into the base: in place where the base has its weights; on a meta-device base, handed to its loader
    (:data:`FOLD_ATTR`, read by :class:`~packtrain.models.loading.WeightMap`); not at all under fake tensors
    (``plan --measure``: shapes only)."""
    from torch._subclasses.fake_tensor import FakeTensor

    if start is None:
        return model
    fold = Fold(start.links, model)
    params = list(model.parameters())
    if any(p.is_meta for p in params):
        setattr(model, FOLD_ATTR, fold)
    elif not any(isinstance(p, FakeTensor) for p in params):
        fold.fold_in_place(model)
    return model
