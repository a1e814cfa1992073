"""Fill a model built on the meta device from a safetensors checkpoint, each rank reading only what it keeps.

The model is built without weights (:func:`packtrain.models.build.build_base_model` with ``meta=True``), wrapped
(LoRA, patch, checkpointing, ``fully_shard``; :mod:`packtrain.models.wrap`), and only then given memory: ``to_empty``
allocates each rank's shards, and every tensor is filled in place from its source:

- LoRA weights and non-persistent buffers (rotary ``inv_freq``, ...) were made for real at build time (the
  adapters seeded, the buffers computed by the module's own ``__init__``): kept before ``to_empty``, copied back.
- Every other tensor is read from the checkpoint: for a tensor sharded by FSDP only this rank's rows, through a
  memory-mapped ``safe_open(...).get_slice(key)[rows]``; the file is opened per tensor, so what the mapping keeps
  resident never exceeds one slice. Peak host memory per rank: its shards plus one tensor's slice.

Which checkpoint tensor feeds which parameter comes from the model itself, never from per-family names: the
parameter's name in the transformers model (recorded by module identity before LoRA and wrappers rename them),
and transformers' own checkpoint conversion mapping (``get_model_conversion_mapping``: the vision-language
``model.language_model.*`` layout read by a text class, renamed legacy keys; converters such as stacked MoE experts
are run on the whole source tensors, then sliced). Checkpoint tensors the class does not load (``mtp.*``, the
vision tower under a text class) are counted and left alone.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from packtrain.config.typed import read_json_object
from packtrain.models.start_adapter import FOLD_ATTR

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class SafetensorsCheckpoint:
    """The tensors of a local checkpoint directory: sharded (``model.safetensors.index.json``) or one file."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        index = self.path / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{index}: not a safetensors index (no weight_map): {e}") from None
            self.file_of = {k: self.path / f for k, f in weight_map.items()}
            missing = sorted({str(f) for f in self.file_of.values() if not f.is_file()})
            if missing:
                raise ValueError(f"{index} names shard files that do not exist: {', '.join(missing)}")
        elif (self.path / SINGLE_FILE).is_file():
            with _opened(self.path / SINGLE_FILE) as f:
                self.file_of = {k: self.path / SINGLE_FILE for k in f.keys()}
        else:
            raise ValueError(f"model.path: {self.path} has neither {INDEX_FILE} nor {SINGLE_FILE} (packtrain "
                             "reads safetensors checkpoints only)")

    def check_files(self) -> None:
        """Open every shard's header (memory-mapped, no tensor read): a truncated or damaged shard is a
        :class:`ValueError` naming it before the model is built, not safetensors' traceback mid-load."""
        for path in self.files():
            with _opened(path):
                pass

    def keys(self) -> list[str]:
        return list(self.file_of)

    def files(self) -> list[Path]:
        return sorted(set(self.file_of.values()))

    def read(self, key: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """The tensor ``key``, or only ``index`` of it (a tuple of slices, leading dims): only those bytes are read.

        The file is opened (memory-mapped) for this one read and closed after, so its pages stop counting
        towards this process's resident memory."""
        from safetensors import safe_open

        with safe_open(str(self.file_of[key]), framework="pt") as f:
            if not index:
                return f.get_tensor(key)
            return f.get_slice(key)[index]


@contextlib.contextmanager
def _opened(path: Path):
    from safetensors import safe_open

    try:
        f = safe_open(str(path), framework="pt")
    except Exception as e:  # noqa: BLE001 - safetensors' own error types: any of them means unreadable
        raise ValueError(f"model.path: {path}: unreadable ({type(e).__name__}: {str(e)[:200]}); a damaged or "
                         "truncated copy?") from None
    with f:
        yield f


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters (malloc.h)
MMAP_THRESHOLD_MAX = 32 * 2**20  # the largest M_MMAP_THRESHOLD glibc takes on 64-bit
TRIM_THRESHOLD_MAX = 2**31 - 1  # mallopt takes an int


def _mallopt(*settings: tuple[int, int]) -> bool:
    """Set glibc malloc parameters; False where the C library is not glibc."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        return all(bool(libc.mallopt(param, value)) for param, value in settings)
    except (OSError, AttributeError, TypeError):
        return False


def fix_mmap_threshold(nbytes: int = 128 * 1024) -> bool:
    """Keep glibc from holding freed tensors: it starts by mapping allocations of 128 KiB and more on their own
    (returned to the system on free), but after the first such free it raises that threshold to the freed size,
    up to 32 MiB, and from then on serves and keeps them in its heap. Each loaded slice and every FSDP all-gather
    buffer below 32 MiB then stays resident after use (docs/performance.md, "Loading a checkpoint across ranks").
    Setting it fixes it at ``nbytes``, and the heap's trim threshold (raised along with it) back to its default of
    the same size. False where the C library is not glibc."""
    return _mallopt((M_MMAP_THRESHOLD, nbytes), (M_TRIM_THRESHOLD, nbytes))


def keep_heap_between_steps() -> bool:
    """Training on the CPU, where every activation is host memory: serve tensors below 32 MiB from glibc's heap
    and keep the heap between steps. Otherwise a step's large activations are mapped fresh and faulted in page by
    page, every step (all of them above 128 KiB after :func:`fix_mmap_threshold`; above the last size freed
    without it), and the heap is handed back whenever its free top outgrows the trim threshold. A pack's
    activations are several times one example's, so this cost fell on packs (docs/performance.md, "The heap, and
    what it hid"). Resident memory then stays at the step's peak between steps, which the next step reaches again
    anyway. Set after loading, so loading keeps its own threshold."""
    return _mallopt((M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX), (M_TRIM_THRESHOLD, TRIM_THRESHOLD_MAX))


def module_names(model: nn.Module) -> dict[nn.Module, str]:
    """Every module of a transformers model -> its name, recorded before LoRA and wrappers rename them."""
    return {m: name for name, m in model.named_modules()}


@dataclass
class _Converted:
    """Target parameters made by one transformers WeightConverter from several checkpoint tensors."""

    converter: object
    sources: list[tuple[str, str]] = field(default_factory=list)  # (source pattern, checkpoint key)
    done: dict[str, torch.Tensor] | None = None


class WeightMap:
    """Model parameter name -> where its value is in the checkpoint, from transformers' conversion mapping. A start
    adapter the model was given (``model.adapter``: :func:`packtrain.models.start_adapter.fold_base`) is folded into
    every tensor read, slice by slice."""

    def __init__(self, model: nn.Module, checkpoint: SafetensorsCheckpoint):
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, rename_source_key

        self.model = model
        self.checkpoint = checkpoint
        self.fold = getattr(model, FOLD_ATTR, None)
        wanted = model.state_dict()  # meta tensors: names only
        transforms = get_model_conversion_mapping(model)
        renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
        converters = [t for t in transforms if isinstance(t, WeightConverter)]
        by_pattern = {p: c for c in converters for p in c.source_patterns}
        prefix = getattr(model, "base_model_prefix", None)
        self.direct: dict[str, str] = {}
        self.converted: dict[str, _Converted] = {}
        self.extra: list[str] = []
        for key in sorted(checkpoint.keys()):
            name, pattern = rename_source_key(key, renamings, converters, prefix, wanted)
            if name not in wanted and key in wanted:  # transformers' own fallback: keep the key as it is
                name, pattern = key, None
            if name not in wanted:
                self.extra.append(key)
            elif pattern is None:
                self.direct[name] = key
            else:
                group = self.converted.setdefault(name, _Converted(copy.deepcopy(by_pattern[pattern])))
                group.sources.append((pattern, key))
        self.tied = dict(getattr(model, "all_tied_weights_keys", None) or {})
        # a converter with several targets (qkv -> q, k, v) is filed under its first one
        self.target_group = {}
        for first, group in self.converted.items():
            for target in group.converter.target_patterns:
                self.target_group[first.replace(group.converter.target_patterns[0], target)] = first

    def _resolve(self, name: str) -> str:
        """A tied parameter missing from the checkpoint (``lm_head.weight``) reads the one it is tied to."""
        if name not in self.direct and name not in self.target_group:
            return self.tied.get(name, name)
        return name

    def has(self, name: str) -> bool:
        name = self._resolve(name)
        return name in self.direct or name in self.target_group

    def read(self, name: str, index: tuple[slice, ...] | None) -> torch.Tensor:
        name = self._resolve(name)
        tensor = self._read(name, index)
        return self.fold.apply(name, tensor, index) if self.fold is not None else tensor

    def _read(self, name: str, index: tuple[slice, ...] | None) -> torch.Tensor:
        if name in self.direct:
            return self.checkpoint.read(self.direct[name], index)
        group = self.converted[self.target_group[name]]
        if group.done is None:  # run the converter once on whole tensors; each target is sliced from its result
            conv = group.converter
            for pattern, key in group.sources:
                conv.add_tensor(self.target_group[name], key, pattern, lambda k=key: self.checkpoint.read(k))
            out = conv.convert(self.target_group[name], model=self.model, config=self.model.config)
            group.done = {k: (v[0] if isinstance(v, list) else v) for k, v in out.items()}
        full = group.done.pop(name)
        return full[index] if index else full

    def extra_summary(self) -> str:
        """``mtp.*: 12, model.visual.*: 40`` (by first name component)."""
        counts = Counter(k.split(".")[0] if not k.startswith("model.") else ".".join(k.split(".")[:2])
                         for k in self.extra)
        return ", ".join(f"{p}.*: {n}" for p, n in sorted(counts.items()))


def local_index(t: torch.Tensor) -> tuple[slice, ...] | None:
    """This rank's part of a (possibly FSDP-sharded) tensor as slices of the full tensor; None: all of it."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return None
    starts, sizes = [0] * t.ndim, list(t.shape)
    coordinate = t.device_mesh.get_coordinate()
    for mesh_dim, placement in enumerate(t.placements):
        if placement.is_shard():
            d, n = placement.dim, t.device_mesh.size(mesh_dim)
            chunk = math.ceil(sizes[d] / n)  # torch.chunk's split, as FSDP2 shards
            lo = min(coordinate[mesh_dim] * chunk, sizes[d])
            starts[d], sizes[d] = starts[d] + lo, min(chunk, sizes[d] - lo)
        elif not placement.is_replicate():
            raise ValueError(f"cannot load a tensor placed as {placement} (only Shard and Replicate)")
    if tuple(sizes) != tuple(t.to_local().shape):
        raise RuntimeError(f"local shard {tuple(t.to_local().shape)} is not the expected {tuple(sizes)}")
    return tuple(slice(s, s + n) for s, n in zip(starts, sizes))


def is_meta(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def real_tensors(root: nn.Module) -> dict[tuple[nn.Module, str], torch.Tensor]:
    """Copies of the tensors of a meta model that already have values (adapters, non-persistent buffers)."""
    kept = {}
    for module in root.modules():
        for name, t in [*module._parameters.items(), *module._buffers.items()]:
            if t is not None and not t.is_meta:
                kept[(module, name)] = t.detach().clone()
    return kept


def peft_copies(root: nn.Module, names: dict[nn.Module, str]) -> dict[nn.Module, str]:
    """``names`` extended to peft's trainable copies (modules_to_save), which start as the module they copy."""
    names = dict(names)
    for wrapper in root.modules():
        original, copies = getattr(wrapper, "original_module", None), getattr(wrapper, "modules_to_save", None)
        if original is None or not isinstance(copies, nn.ModuleDict):
            continue
        for module_copy in copies.values():
            for a, b in zip(original.modules(), module_copy.modules()):
                if a in names:
                    names[b] = names[a]
    return names


BLOCK_BYTES = 64 * 2**20


def _fill_in_blocks(local: torch.Tensor, key: str, index: tuple[slice, ...] | None, weights: WeightMap) -> None:
    """Copy the checkpoint's ``index`` of ``key`` into ``local``, at most 64 MiB of rows per read: a
    vocabulary-sized slice (1.2 GiB of Qwen3.6-27B's embedding per rank of 2) never sits in memory twice (read
    buffer and mapped pages) on top of the shards."""
    if local.dim() == 0 or not weights.direct.get(weights._resolve(key)):
        local.copy_(weights.read(key, index))
        return
    index = index or tuple(slice(0, n) for n in local.shape)
    rows = max(1, BLOCK_BYTES // max(1, local[0].numel() * local.element_size()))
    start = index[0].start
    for i in range(0, local.shape[0], rows):
        j = min(i + rows, local.shape[0])
        local[i:j].copy_(weights.read(key, (slice(start + i, start + j), *index[1:])))


@dataclass
class LoadReport:
    read: int  # tensors filled from the checkpoint
    kept: int  # tensors that had values before (adapters, computed buffers)
    extra: str  # checkpoint tensors the class does not load, by prefix
    path: Path
    world_size: int

    def describe(self) -> str:
        sharded = f"each of {self.world_size} ranks reading its shards" if self.world_size > 1 else "read"
        ignored = f"; not loaded by the model class: {self.extra}" if self.extra else ""
        return f"{self.read} tensors from {self.path} on the meta device, then {sharded}{ignored}"


@torch.no_grad()
def materialize(root: nn.Module, kept: dict, names: dict[nn.Module, str], weights: WeightMap,
                device: torch.device) -> LoadReport:
    """Allocate ``root`` on ``device`` (each rank its shards) and fill every tensor (see the module docstring)."""
    tied = {}  # parameter objects under several names (tied embeddings) stay one object
    for module in root.modules():
        for name, p in module._parameters.items():
            if p is not None:
                tied.setdefault(id(p), []).append((module, name))
    root.to_empty(device=device)
    for slots in tied.values():
        first = getattr(slots[0][0], slots[0][1])
        for module, name in slots[1:]:
            if getattr(module, name) is not first:
                setattr(module, name, first)
    names = peft_copies(root, names)
    done, read, missing = set(), 0, []
    for module in root.modules():
        for name, t in [*module._parameters.items(), *module._buffers.items()]:
            if t is None or id(t) in done:
                continue
            done.add(id(t))
            index = local_index(t)
            local = t.to_local() if index is not None else t
            if (module, name) in kept:
                full = kept[(module, name)]
                local.copy_(full[index] if index else full)
                continue
            key = f"{names[module]}.{name}" if module in names else None
            if key is None or not weights.has(key):
                missing.append(key or f"{type(module).__name__}.{name}")
                continue
            _fill_in_blocks(local, key, index, weights)
            read += 1
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise ValueError(f"model.path: {weights.checkpoint.path} lacks {len(missing)} tensors the model needs: {shown}")
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    return LoadReport(read, len(kept), weights.extra_summary(), weights.checkpoint.path, world)


def read_adapter(adapter_dir: Path, flag: str = "--adapter") -> dict:
    """A PEFT adapter directory's tensors after checking it can be read: its ``adapter_config.json`` is JSON and its
    ``adapter_model.safetensors`` loads whole. A truncated or damaged file is a :class:`ValueError` naming it (one
    line at the CLI), not safetensors' traceback."""
    adapter_dir = Path(adapter_dir)
    config, weights = adapter_dir / "adapter_config.json", adapter_dir / "adapter_model.safetensors"
    for path in (config, weights):
        if not path.is_file():
            raise ValueError(f"{flag}: {adapter_dir} is not a PEFT adapter directory (no {path.name})")
    read_json_object(config, flag)
    from safetensors.torch import load_file

    try:
        return load_file(str(weights))
    except Exception as e:  # noqa: BLE001 - safetensors' own error types: any of them means unreadable
        raise ValueError(f"{flag}: {weights}: unreadable ({type(e).__name__}: {str(e)[:200]}); a damaged or "
                         "truncated copy?") from None
