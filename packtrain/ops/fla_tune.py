"""Pinned FLA autotune: Triton's winners written as FLA ``default_config`` files, and read back.

Why: fla tunes ``l2norm_fwd/bwd`` on ``[D, NB]`` with ``NB = cdiv(T, 65536)``, so a full-length run meets a bucket a
short run never tuned, and Triton's benchmark of it at full length can run out of memory in the first backward.
``packtrain pretune-fla`` runs one update with a shortened prompt, takes every fla kernel Triton tuned, and writes

    $FLA_CONFIG_DIR/{kernel}.json = {"kernel_name", "triton_version", "autotune_entries": {},
                                     "default_config": {"kwargs", "num_warps", "num_stages", "num_ctas"},
                                     "packtrain": {"gpu", "tuned_keys", "chosen_key"}}

With ``FLA_CACHE_MODE=default`` fla returns ``default_config`` without looking at the key and never searches. No
shape-keyed entries are written (in that mode fla never reads them); the ``packtrain`` block is for people and
ignored by fla.

Everything here except :func:`collect_tuned` is pure and runs on CPU.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

ENV_MODE, ENV_DIR = "FLA_CACHE_MODE", "FLA_CONFIG_DIR"


class FlaConfigError(ValueError):
    pass


def config_entry(kwargs: dict, num_warps: int, num_stages: int, num_ctas: int = 1,
                 maxnreg: int | None = None) -> dict:
    entry = {"kwargs": dict(kwargs), "num_warps": int(num_warps), "num_stages": int(num_stages),
             "num_ctas": int(num_ctas)}
    if maxnreg is not None:
        entry["maxnreg"] = int(maxnreg)
    return entry


def entry_from_triton(cfg: Any) -> dict:
    """A ``triton.Config`` (read by attribute, so a stand-in works in tests) -> a default_config entry."""
    return config_entry(cfg.kwargs, cfg.num_warps, cfg.num_stages, getattr(cfg, "num_ctas", 1) or 1,
                        getattr(cfg, "maxnreg", None))


def _key_sort(key: tuple) -> tuple:
    return tuple((0, k) if isinstance(k, (int, float)) and not isinstance(k, bool) else (1, str(k)) for k in key)


def choose_default(tuned: dict[tuple, dict]) -> tuple[tuple, dict]:
    """One kernel's winners by tuning key -> (key, entry) to pin. The winner most keys agree on; on a tie, the
    largest key's (the longest inputs tuned). A kernel tuned on several keys is listed by ``pretune-fla``."""
    if not tuned:
        raise FlaConfigError("no tuned configurations to choose from")
    votes = Counter(json.dumps(e, sort_keys=True) for e in tuned.values())
    best = max(votes.values())
    candidates = [k for k, e in tuned.items() if votes[json.dumps(e, sort_keys=True)] == best]
    key = max(candidates, key=_key_sort)
    return key, tuned[key]


def config_file(kernel: str, tuned: dict[tuple, dict], gpu: str, triton_version: str) -> dict:
    key, entry = choose_default(tuned)
    return {"kernel_name": kernel, "triton_version": triton_version, "autotune_entries": {},
            "default_config": entry,
            "packtrain": {"gpu": gpu, "tuned_keys": [list(k) for k in sorted(tuned, key=_key_sort)],
                          "chosen_key": list(key)}}


def write_fla_configs(out_dir: Path, tuned: dict[str, dict[tuple, dict]], gpu: str, triton_version: str) -> list[Path]:
    """One ``{kernel}.json`` per kernel in ``out_dir``; returns the paths written."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for kernel in sorted(tuned):
        path = out_dir / f"{kernel}.json"
        path.write_text(json.dumps(config_file(kernel, tuned[kernel], gpu, triton_version), indent=2) + "\n")
        written.append(path)
    return written


def read_fla_configs(config_dir: Path) -> dict[str, dict]:
    """kernel -> default_config of every ``*.json`` in ``config_dir`` (empty when the folder is missing). A file fla
    would ignore (not JSON, or a default_config without kwargs/num_warps/num_stages) is an error naming it."""
    config_dir = Path(config_dir)
    if not config_dir.is_dir():
        return {}
    configs = {}
    for path in sorted(config_dir.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise FlaConfigError(f"{path}: not valid JSON ({e})") from None
        default = data.get("default_config") if isinstance(data, dict) else None
        if not isinstance(default, dict) or not {"kwargs", "num_warps", "num_stages"} <= default.keys():
            raise FlaConfigError(f"{path}: no default_config with kwargs, num_warps and num_stages")
        configs[path.stem] = default
    return configs


def configs_digest(configs: dict[str, dict]) -> str:
    return hashlib.sha256(json.dumps(configs, sort_keys=True).encode()).hexdigest()[:12]


def launch_env(config_dir: Path) -> str:
    return f"{ENV_MODE}=default {ENV_DIR}={Path(config_dir).resolve()}"


# -- on the GPU ----------------------------------------------------------------------------------------------
def _autotuners(obj: Any):
    """The Triton autotuner under ``obj`` (through ``triton.heuristics`` wrappers), or None."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import KernelInterface

    seen = 0
    while isinstance(obj, KernelInterface) and seen < 8:
        if isinstance(obj, Autotuner):
            return obj
        obj, seen = getattr(obj, "fn", None), seen + 1
    return None


def collect_tuned(modules: dict | None = None) -> tuple[dict[str, dict[tuple, dict]], list[str]]:
    """After a run: (kernel -> {tuning key -> winner} for fla's cache-aware autotuners that tuned something,
    names of fla kernels tuned by plain ``triton.autotune``, which FLA's cache cannot pin)."""
    from fla.ops.utils.cache import CachedAutotuner

    modules = sys.modules if modules is None else modules
    tuned: dict[str, dict[tuple, dict]] = {}
    plain: set[str] = set()
    for name, module in list(modules.items()):
        if not (name == "fla" or name.startswith("fla.")) or module is None:
            continue
        for value in list(vars(module).values()):
            tuner = _autotuners(value)
            if tuner is None or not tuner.cache:
                continue
            kernel = getattr(tuner.fn, "fn", tuner.fn).__name__
            if isinstance(tuner, CachedAutotuner):
                tuned.setdefault(kernel, {}).update({tuple(k): entry_from_triton(c) for k, c in tuner.cache.items()})
            else:
                plain.add(kernel)
    return tuned, sorted(plain)
