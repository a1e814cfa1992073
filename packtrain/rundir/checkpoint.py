"""Adapters and checkpoints on disk, always written under a temporary name and renamed into place.

``OUTPUT/checkpoints/step-N/``: ``adapter/`` (PEFT format), ``trainable.safetensors`` (the same tensors under
the model's parameter names), ``optimizer.pt`` (full state keyed by parameter names), ``scheduler.pt``,
``rng-rank-R.pt`` (one per rank), ``state.json``: the step (which fixes the data cursor), a fingerprint of the plan,
the resolved config and the sha256 of every other file, and ``state.sha256``, written last: the sha256 of
``state.json`` itself. Everything is gathered to full
tensors with every rank taking part and written by rank 0, so a checkpoint resumes under any world size. A
directory only ever appears complete (written under ``.tmp-step-N`` and renamed).

Why digests and safe loads: a disk that fills up, a copy cut short or a changed byte would otherwise resume
silently into garbage, and ``torch.load`` of an arbitrary pickle runs code. :func:`verify_checkpoint` checks every
digest and loads every file the way a resume does (safetensors, JSON, ``torch.load(weights_only=True)``), so a
damaged checkpoint is found before any rank starts loading (:mod:`packtrain.rundir.resume` then falls back to an older
one). A ``state.json`` is believed only when its own digest matches and it agrees with itself and its directory
(the step is ``step-N``'s N, within the run's total, the counters within it): an edited step resumed from a step
that was never trained, skipping a pack, with exit 0.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import DTensor, distribute_tensor

from packtrain.distributed import DistInfo, barrier
from packtrain.models.exports import plain_modes
from packtrain.models.start_adapter import RECORD

STEP_DIR = re.compile(r"^step-(\d+)$")
STATE = "state.json"
STATE_DIGEST = "state.sha256"  # the digest of state.json, beside it


class CheckpointDamaged(ValueError):
    """A checkpoint that must not be resumed from: a missing, truncated, changed or unreadable file."""


def _atomic_dir(final: Path, write) -> Path:
    """Write a directory with ``write(tmp_path)`` and rename it to ``final`` (replacing an older one)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    write(tmp)
    return _rename_into_place(tmp, final)


def _rename_into_place(tmp: Path, final: Path) -> Path:
    """``tmp`` becomes ``final``; an existing ``final`` is moved aside first and removed only afterwards."""
    if final.exists():
        old = final.parent / f".old-{final.name}-{os.getpid()}"
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old)
    else:
        tmp.rename(final)
    return final


WRAPPER = "_checkpoint_wrapped_module."


def write_adapter(peft_model, directory: Path, trainable: dict) -> None:
    """peft's ``save_pretrained`` with the full trainable tensors (peft names, see :func:`clean_name`), and beside
    them the base and the start the adapter trained on (the model's ``packtrain_base_record``, as
    :data:`packtrain.models.start_adapter.RECORD`), which a run that starts from it checks and follows.

    peft 0.21 picks the adapter's keys by walking the model's modules, whose names carry activation checkpointing's
    wrapper; handed unwrapped names it wrote an adapter of 0 tensors. So it gets the tensors under the names it
    walks, and the wrapper is dropped from the keys it wrote, so the adapter loads into an unwrapped model."""
    names = {n.replace(WRAPPER, ""): n for n, _ in peft_model.named_parameters()}
    peft_model.save_pretrained(directory, state_dict={names.get(k, k): v for k, v in trainable.items()})
    if any(WRAPPER in n for n in names.values()):
        path = Path(directory) / "adapter_model.safetensors"
        tensors = load_file(str(path))
        save_file({k.replace(WRAPPER, ""): v for k, v in tensors.items()}, str(path), metadata={"format": "pt"})
    _sorted_target_modules(Path(directory) / "adapter_config.json")
    base = getattr(peft_model, "packtrain_base_record", None)
    if base is not None:
        (Path(directory) / RECORD).write_text(json.dumps(base, indent=2) + "\n")
    plain_modes(Path(directory))  # peft writes the weights 0600: a server run by another user could not read them


def _sorted_target_modules(path: Path) -> None:
    """peft writes ``target_modules`` from a set, in an order that changes with the interpreter's string hashing: two
    runs of one config wrote adapter_config.json files that differ. Sorted, equal runs write equal bytes (peft's own
    format otherwise: ``indent=2, sort_keys=True``)."""
    config = json.loads(path.read_text())
    if isinstance(config.get("target_modules"), list):
        config["target_modules"] = sorted(config["target_modules"])
        path.write_text(json.dumps(config, indent=2, sort_keys=True))


ADAPTER_STEP = "packtrain_step.json"  # beside the final adapter's PEFT files: the step it was trained to


def save_adapter(model, path: Path, state_dict: dict, step: int | None = None) -> Path:
    """The adapter in PEFT format (loadable with ``PeftModel.from_pretrained``), atomically; with ``step``, also
    :data:`ADAPTER_STEP` (``{"step": N}``), which a resume reads (it never replaces it with an earlier one)."""
    def write(tmp: Path) -> None:
        write_adapter(model, tmp, state_dict)
        if step is not None:
            (tmp / ADAPTER_STEP).write_text(json.dumps({"step": step}) + "\n")

    return _atomic_dir(Path(path), write)


def final_adapter_step(output_dir: Path) -> int | None:
    """The step ``OUTPUT/adapter`` was trained to, None without one (or one written by an older packtrain)."""
    try:
        step = json.loads((Path(output_dir) / "adapter" / ADAPTER_STEP).read_text()).get("step")
    except (OSError, ValueError, AttributeError):
        return None
    return step if isinstance(step, int) else None


def rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def clean_name(name: str) -> str:
    """A parameter name of the wrapped root -> the name in the peft model (no root prefix, no wrapper)."""
    name = name.replace(WRAPPER, "")
    return name[len("model."):] if name.startswith("model.") else name


def trainable_state(lm, info: DistInfo) -> dict | None:
    """Full trainable tensors (peft names) on rank 0, None elsewhere. Every rank must call it: under FSDP each
    tensor is all-gathered, in the same order everywhere."""
    out = {}
    for name, p in lm.named_parameters():
        if not p.requires_grad:
            continue
        t = p.detach()
        if isinstance(t, DTensor):
            t = t.full_tensor()
        if info.is_main:
            out[clean_name(name)] = t.cpu().clone()
    return out if info.is_main else None


def load_trainable_state(lm, state: dict | None, info: DistInfo) -> None:
    """Inverse of :func:`trainable_state`: rank 0's full tensors broadcast and sharded like each parameter."""
    for name, p in lm.named_parameters():
        if not p.requires_grad:
            continue
        if info.is_main:
            full = state[clean_name(name)].to(device=info.device, dtype=p.dtype)
        else:
            full = torch.empty(p.shape, dtype=p.dtype, device=info.device)
        if info.enabled:
            dist.broadcast(full, src=0)
        with torch.no_grad():
            if isinstance(p, DTensor):
                p.copy_(distribute_tensor(full, p.device_mesh, p.placements))
            else:
                p.copy_(full)


def _state_dict_options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kw)


def optimizer_state(lm, optimizer) -> dict:
    """Full optimizer state keyed by parameter names (world-size independent); complete on rank 0."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(lm, optimizer, options=_state_dict_options(cpu_offload=True))


def load_optimizer_state(lm, optimizer, state: dict | None, info: DistInfo) -> None:
    """Rank 0's saved optimizer state into every rank's optimizer. An optimizer that keeps nothing per parameter
    (SGD without momentum) has nothing to restore (its hyperparameters are the config's, its learning rate the
    scheduler's), and torch's loader cannot place an empty state (it asserts "Expected device to be set")."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    stateless = [bool(state is not None and not state.get("state"))]
    if info.enabled:  # rank 0 alone has read the file: it decides for every rank
        dist.broadcast_object_list(stateless, src=0)
    if stateless[0]:
        return
    set_optimizer_state_dict(lm, optimizer, optim_state_dict=state if state is not None else {},
                             options=_state_dict_options(broadcast_from_rank0=info.enabled))


def save_checkpoint(output_dir: Path, step: int, lm, peft_model, optimizer, scheduler, state: dict,
                    info: DistInfo) -> Path | None:
    """Every rank takes part (gathers, its own RNG file); rank 0 writes the rest and renames the directory."""
    final = Path(output_dir) / "checkpoints" / f"step-{step}"
    tmp = final.parent / f".tmp-{final.name}"
    if info.is_main:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    trainable = trainable_state(lm, info)
    optim = optimizer_state(lm, optimizer)
    barrier(info)
    torch.save(rng_state(), tmp / f"rng-rank-{info.rank}.pt")
    barrier(info)
    if info.is_main:
        write_adapter(peft_model, tmp / "adapter", trainable)
        save_file(trainable, str(tmp / "trainable.safetensors"))
        torch.save(optim, tmp / "optimizer.pt")
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        files = {rel: file_digest(tmp / rel) for rel in _files(tmp)}
        write_state(tmp, {**state, "step": step, "files": files})
        _rename_into_place(tmp, final)  # the same step again: a resume that fell back past it
    barrier(info)
    return final


def write_state(ckpt: Path, state: dict) -> None:
    """``state.json`` and then its digest, ``state.sha256``."""
    (Path(ckpt) / STATE).write_text(json.dumps(state, indent=2))
    (Path(ckpt) / STATE_DIGEST).write_text(file_digest(Path(ckpt) / STATE) + "\n")


def _files(ckpt: Path) -> list[str]:
    return sorted(str(f.relative_to(ckpt)) for f in ckpt.rglob("*")
                  if f.is_file() and f.relative_to(ckpt).as_posix() not in (STATE, STATE_DIGEST))


def file_digest(path: Path) -> str:
    """A file's SHA-256 (hex): the one file digest of a run (checkpoints, and what check-nodes compares across
    ranks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def _safe_torch_load(path: Path):
    # weights_only: tensors and plain containers only; a pickle that would run code raises instead
    return torch.load(path, map_location="cpu", weights_only=True)


def _count(state: dict, key: str) -> int | None:
    value = state.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def read_state(ckpt: Path) -> dict:
    """``state.json`` once its digest matches and it is consistent with itself and with the directory's name."""
    ckpt = Path(ckpt)
    path, digest = ckpt / STATE, ckpt / STATE_DIGEST
    try:
        state = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointDamaged(f"{path}: missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointDamaged(f"{path}: unreadable ({e})") from None
    if not isinstance(state, dict) or _count(state, "step") is None or not isinstance(state.get("files"), dict):
        raise CheckpointDamaged(f"{path}: no step or file digests (written by an older packtrain, or damaged)")
    try:
        expected = digest.read_text().strip()
    except FileNotFoundError:
        raise CheckpointDamaged(f"{digest}: missing (written by an older packtrain, or damaged)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointDamaged(f"{digest}: unreadable ({e})") from None
    if file_digest(path) != expected:
        raise CheckpointDamaged(f"{path}: contents differ from the digest in {STATE_DIGEST} (edited or damaged)")
    step, total, skips = _count(state, "step"), _count(state, "total_steps"), _count(state, "nonfinite_skips")
    named = STEP_DIR.match(ckpt.name)
    if named and int(named.group(1)) != step:
        raise CheckpointDamaged(f"{path}: step {step} in a directory named {ckpt.name}")
    if total is None or not 1 <= step <= total:
        raise CheckpointDamaged(f"{path}: step {step} is not within the run's total_steps {state.get('total_steps')!r}")
    if skips is None or not 0 <= skips <= step:
        raise CheckpointDamaged(f"{path}: nonfinite_skips {state.get('nonfinite_skips')!r} is not within 0..{step}")
    return state


def verify_checkpoint(ckpt: Path) -> dict:
    """The checkpoint's state after checking every file's digest and reading it as a resume will; raises
    :class:`CheckpointDamaged` naming the first bad file."""
    ckpt = Path(ckpt)
    state = read_state(ckpt)
    for rel, digest in sorted(state["files"].items()):
        path = ckpt / rel
        if not path.is_file():
            raise CheckpointDamaged(f"{path}: missing")
        if file_digest(path) != digest:
            raise CheckpointDamaged(f"{path}: contents differ from the digest in {STATE} (truncated or changed)")
    for name in ("trainable.safetensors", "optimizer.pt", "scheduler.pt", "rng-rank-0.pt"):
        if name not in state["files"]:
            raise CheckpointDamaged(f"{ckpt / name}: not listed in {STATE}")
    for rel in state["files"]:
        try:
            if rel.endswith(".safetensors"):
                load_file(str(ckpt / rel))
            elif rel.endswith(".pt"):
                _safe_torch_load(ckpt / rel)
            elif rel.endswith(".json"):
                json.loads((ckpt / rel).read_text())
        except pickle.UnpicklingError as e:  # torch's text advises weights_only=False: code would run
            raise CheckpointDamaged(f"{ckpt / rel}: unreadable (a pickle that holds more than tensors and plain "
                                    f"containers: {_unpickler_reason(e)}; loading it otherwise could run code, so "
                                    "packtrain never does)") from None
        except Exception as e:  # noqa: BLE001 - any failure to read means: do not resume from here
            raise CheckpointDamaged(f"{ckpt / rel}: unreadable ({type(e).__name__}: {str(e)[:200]})") from None
    return state


def _unpickler_reason(e: Exception) -> str:
    """What torch's weights-only unpickler refused ("Unsupported global: ..."), without its advice to re-run with
    weights_only=False."""
    text = str(e)
    reason = text.split("WeightsUnpickler error:", 1)[1] if "WeightsUnpickler error:" in text else ""
    reason = " ".join(reason.split("Check the documentation", 1)[0].split())
    return reason[:200] or "refused by torch.load(weights_only=True)"


def load_checkpoint(ckpt: Path, lm, optimizer, scheduler, info: DistInfo) -> dict:
    """Adapter weights, optimizer, scheduler and this rank's RNG (rank 0's when the world size changed). The
    checkpoint has been verified (:func:`verify_checkpoint`) by rank 0 before any rank calls this."""
    state = read_state(ckpt)
    trainable = load_file(str(ckpt / "trainable.safetensors")) if info.is_main else None
    load_trainable_state(lm, trainable, info)
    optim = _safe_torch_load(ckpt / "optimizer.pt") if info.is_main else None
    load_optimizer_state(lm, optimizer, optim, info)
    scheduler.load_state_dict(_safe_torch_load(ckpt / "scheduler.pt"))
    rng_file = ckpt / f"rng-rank-{info.rank}.pt"
    set_rng_state(_safe_torch_load(rng_file if rng_file.exists() else ckpt / "rng-rank-0.pt"))
    return state


def checkpoints(output_dir: Path) -> list[Path]:
    """``checkpoints/step-N`` directories, newest first."""
    root = Path(output_dir) / "checkpoints"
    if not root.is_dir():
        return []
    steps = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(steps, reverse=True)]
