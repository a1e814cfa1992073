"""Adapters and checkpoints on disk, always written under a temporary name and renamed into place.

``OUTPUT/checkpoints/step-N/``: ``adapter/`` (PEFT format), ``optimizer.pt``, ``scheduler.pt``, ``rng.pt`` and
``state.json`` (the step, which fixes the data cursor, and a fingerprint of the plan). A directory only ever
appears complete, so the newest ``step-N`` is always safe to resume from.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path

import torch

STEP_DIR = re.compile(r"^step-(\d+)$")


def _atomic_dir(final: Path, write) -> Path:
    """Write a directory with ``write(tmp_path)`` and rename it to ``final`` (replacing an older one)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    write(tmp)
    if final.exists():
        old = final.parent / f".old-{final.name}-{os.getpid()}"
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old)
    else:
        tmp.rename(final)
    return final


def save_adapter(model, path: Path, state_dict: dict | None = None) -> Path:
    """PEFT ``save_pretrained`` (loadable with ``PeftModel.from_pretrained``), atomically."""
    return _atomic_dir(Path(path), lambda tmp: model.save_pretrained(tmp, state_dict=state_dict))


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


def save_checkpoint(output_dir: Path, step: int, model, optimizer, scheduler, state: dict,
                    adapter_state: dict | None = None, optimizer_state: dict | None = None) -> Path:
    def write(tmp: Path):
        tmp.mkdir(parents=True)
        model.save_pretrained(tmp / "adapter", state_dict=adapter_state)
        torch.save(optimizer_state if optimizer_state is not None else optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        torch.save(rng_state(), tmp / "rng.pt")
        (tmp / "state.json").write_text(json.dumps({**state, "step": step}, indent=2))

    return _atomic_dir(Path(output_dir) / "checkpoints" / f"step-{step}", write)


def latest_checkpoint(output_dir: Path) -> Path | None:
    root = Path(output_dir) / "checkpoints"
    if not root.is_dir():
        return None
    steps = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir()]
    return max(steps)[1] if steps else None


def read_state(ckpt: Path) -> dict:
    return json.loads((ckpt / "state.json").read_text())


def load_adapter_weights(ckpt_adapter: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(ckpt_adapter / "adapter_model.safetensors"))
