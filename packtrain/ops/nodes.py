"""What every rank actually imports, gathered to every rank and compared, before step 0.

Why: matching requirements files do not make matching installs, and a worker that imports another transformers
minor version can issue other collectives in backward: a silent hang. So the report is what the process *imports*
(``module.__version__`` and the folder it was loaded from), never what a requirements file lists.

Compared across ranks: the Python, torch, transformers, peft, accelerate, fla, causal_conv1d, triton and packtrain
versions *and* their install folders (the same version from another folder is another install, e.g. another
checkout of packtrain: its sources are also hashed), CUDA and NCCL versions, the GPU name, and the FLA autotune
cache fla will use (mode, folder, a digest of the pinned default configs). Not compared: the host name.

The config too, with everything that changes what a rank computes (:func:`config_settings`, compared by
:func:`check_same_config` before ``train`` writes anything): the resolved config key by key, the contents of every
file it reads (data, chat template, the tokenizer's and the image processor's files, the base checkpoint's config and
index), the launcher's environment packtrain reads, and the versions. Why: machines launched with different
``--set`` options would train together, each rank stepping with its own settings, and machines whose files differ
(a chat template, a tokenizer) would tokenize the same examples otherwise, or, when their plans differ, wait for
each other until ``ops.collective_timeout``. The plans themselves are compared after
(:func:`check_same_plan`). The table shows a ``config`` and a ``data`` digest, and a row per differing key.

Test hook (:mod:`packtrain.faults`): ``PACKTRAIN_TEST_OVERRIDE_RANK<N>="field=value"`` makes rank N report ``value``
for ``field`` (an existing field, else an error); the table marks it.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import os
import platform
import re
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path

from packtrain import versions as tested
from packtrain.data.images import BUNDLED_PROCESSOR, PROCESSOR_FILES
from packtrain.data.jsonl import TOKENIZER_FILES, processor_dir, tokenizer_dir
from packtrain.distributed import LAUNCHER_VARIABLES
from packtrain.faults import OVERRIDE_RANK, node_override
from packtrain.ops import fla_tune
from packtrain.rundir.checkpoint import file_digest

PACKAGES = ("torch", "transformers", "peft", "accelerate", "fla", "causal_conv1d", "triton", "packtrain")
GPU_ONLY = ("fla", "causal_conv1d", "triton")  # described without importing on a machine without CUDA
DISTRIBUTIONS = {"fla": "flash-linear-attention"}  # import name -> distribution name, where they differ
NOT_INSTALLED = "not installed"
NOT_COMPARED = ("host",)
RANGES = "tested ranges"  # the field saying which imported versions lie outside packtrain.versions.TESTED


class NodeMismatchError(ValueError):
    """Ranks import different things; ``fields`` maps each differing field to [(value, ranks), ...]."""

    def __init__(self, message: str, fields: dict[str, list[tuple[str, list[int]]]]):
        super().__init__(message)
        self.fields = fields


@dataclass
class NodeReport:
    rank: int
    fields: dict[str, str]
    overridden: list[str] = field(default_factory=list)
    # the launcher's machine (node) rank: GROUP_RANK, which torchrun and accelerate launch set for every worker
    machine: int = 0
    # the resolved config (dotted key -> value) and its data files' digests (:func:`config_settings`)
    settings: dict[str, str] = field(default_factory=dict)


class ConfigMismatchError(ValueError):
    """Ranks were started with different configs or data; ``keys`` maps each differing key to [(value, ranks)]."""

    def __init__(self, message: str, keys: dict[str, list[tuple[str, list[int]]]]):
        super().__init__(message)
        self.keys = keys


def _package(name: str) -> tuple[str, str]:
    """(version, install folder) of an importable package, as imported by this process. Without CUDA, fla,
    causal_conv1d and triton run only when ``model.kernels: fla`` imports them; not imported yet, they are described
    from their install (metadata version, the folder import would load) instead of paying seconds to import them."""
    spec = importlib.util.find_spec(name)
    if spec is None:
        return NOT_INSTALLED, "-"
    if name in GPU_ONLY and name not in sys.modules and spec.origin and not _cuda():
        return _installed_version(name), str(Path(spec.origin).resolve().parent)
    try:
        module = importlib.import_module(name)
    except Exception as e:  # noqa: BLE001 (fla imports triton and CUDA bits: any failure is a finding to report)
        return f"import failed: {type(e).__name__}: {str(e)[:80]}", "-"
    version = getattr(module, "__version__", None)
    return str(version) if version is not None else _installed_version(name), str(Path(module.__file__).resolve().parent)


def _installed_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version(DISTRIBUTIONS.get(name, name.replace("_", "-")))
    except PackageNotFoundError:
        return "unknown"


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _source_digest() -> str:
    """sha256 of packtrain's own .py files: two checkouts at version 0.1.0 are not the same code."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:12]


def _gpu_fields(device) -> dict[str, str]:
    import torch

    cuda = device is not None and getattr(device, "type", "cpu") == "cuda"
    nccl = "none"
    if cuda and torch.distributed.is_nccl_available():
        v = torch.cuda.nccl.version()
        nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    return {"cuda": torch.version.cuda or "none", "nccl": nccl,
            "gpu": torch.cuda.get_device_name(device) if cuda else "none (cpu)"}


def fla_default_config_dir(fla_folder: str) -> str:
    """The folder fla reads its configs from when ``FLA_CONFIG_DIR`` is unset, without importing fla (seconds, and a
    warning on a machine without CUDA): fla 0.6's ``get_fla_config_dir``, ``fla/configs/<GPU>``, the GPU named by
    ``FLA_GPU_NAME`` or the device, sanitised as fla does (``cpu`` without one). Why: reported from the environment
    alone, a rank that had not imported fla yet said "unset" where one that had said fla's folder."""
    gpu = os.environ.get("FLA_GPU_NAME") or (_cuda_name() if _cuda() else None)
    name = (re.sub(r"[^0-9A-Za-z]+", "_", gpu).strip("_") or "unknown_gpu") if gpu else "cpu"
    return str(Path(fla_folder) / "configs" / name)


def _cuda_name() -> str:
    import torch

    return torch.cuda.get_device_name(0)


def fla_cache_fields(fla_version: str, fla_folder: str = "-") -> dict[str, str]:
    """The FLA cache fla will use: its own view when this process imported it (mode and folder are read at import),
    else the environment and fla's default folder (``fla_folder``: where fla is installed). The pinned configs are
    read from the folder and summarised by kernel count and digest. The same whether or not fla was imported."""
    mode = os.environ.get(fla_tune.ENV_MODE, "disabled")
    folder = os.environ.get(fla_tune.ENV_DIR)
    installed = fla_version != NOT_INSTALLED and not fla_version.startswith("import failed")
    if "fla" in sys.modules and installed:
        from fla.ops.utils import cache

        mode, folder = cache.FLA_CACHE_MODE.value, str(cache.get_fla_config_dir())
    elif folder is None and installed and fla_folder != "-":
        folder = fla_default_config_dir(fla_folder)
    fields = {"FLA_CACHE_MODE": mode, "FLA_CONFIG_DIR": folder or "unset"}
    if folder is None:
        fields["FLA default configs"] = "-"
    elif not Path(folder).is_dir():
        fields["FLA default configs"] = "folder missing"
    else:
        configs = fla_tune.read_fla_configs(Path(folder))
        digest = fla_tune.configs_digest(configs)
        fields["FLA default configs"] = f"{_count(len(configs), 'kernel')}, digest {digest}" if configs else "none"
    return fields


DATA_FILES = ("train", "eval", "chat_template")  # data.* files whose contents every rank must share
# The files of a directory a run reads, by its role (data.tokenizer or model.path or the bundled tokenizer; the
# image processor; model.path's checkpoint): their contents change what a rank computes. A checkpoint's weights are
# left out (tens of GB to hash); its config and index, which say what the weights are, are in.
MODEL_FILES = ("config.json", "model.safetensors.index.json", "generation_config.json")
CONTENTS = " contents"  # the suffix of a setting that is a file's digest (the table's ``data`` row)
VERSION, ENVIRONMENT = "version ", "environment "  # the prefixes of the versions' and the launcher's settings


def _directory_files(folder: Path, names: tuple[str, ...]) -> list[tuple[str, Path]]:
    """(name, path) of each of ``names`` that ``folder`` holds, and of its ``additional_chat_templates/*.jinja``
    (transformers reads those beside a tokenizer)."""
    found = [(name, folder / name) for name in names if (folder / name).is_file()]
    if "chat_template.jinja" in names and (folder / "additional_chat_templates").is_dir():
        found += [(f"additional_chat_templates/{p.name}", p)
                  for p in sorted((folder / "additional_chat_templates").glob("*.jinja"))]
    return found


def input_files(cfg) -> list[tuple[str, Path]]:
    """(setting, path) of every file whose contents change what a rank computes: ``data.train``, ``data.eval`` and
    ``data.chat_template``; the tokenizer's files (``data.tokenizer``, else ``model.path``, else the bundled
    tokenizer); the image processor's (``data.processor``, else ``model.path``'s, else the bundled one); and
    ``model.path``'s config.json, weight index and generation config."""
    files = []
    for name in DATA_FILES:
        path = cfg.resolve_path(getattr(cfg.data, name))
        if path is not None:
            files.append((f"data.{name}{CONTENTS}", path))
    folders = [("tokenizer", tokenizer_dir(cfg), TOKENIZER_FILES),
               ("processor", processor_dir(cfg) or BUNDLED_PROCESSOR, PROCESSOR_FILES),
               ("model.path", cfg.resolve_path(cfg.model.path), MODEL_FILES)]
    for role, folder, names in folders:
        if folder is not None:
            files += [(f"{role} {name}{CONTENTS}", path) for name, path in _directory_files(folder, names)]
    return files


def versions() -> dict[str, str]:
    """What the report's versions say (:func:`node_report`): Python, each of :data:`PACKAGES`, packtrain's sources."""
    out = {"python": platform.python_version()}
    out.update({name: _package(name)[0] for name in PACKAGES})
    out["packtrain source"] = _source_digest()
    return out


def config_settings(cfg) -> dict[str, str]:
    """Everything that changes what a rank computes, as setting -> value: the resolved config as dotted key -> value
    (JSON text; ``model.config`` key by key); ``data.train contents`` etc.: the digest of each file of
    :func:`input_files`, so the same path holding other data (another tokenizer, another template) differs; the
    launcher's environment packtrain reads (``environment ACCELERATE_MIXED_PRECISION``, which can change the config);
    and the versions (``version transformers``: another library version tokenizes or computes otherwise)."""
    flat: dict[str, str] = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict) and value:
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            flat[prefix] = json.dumps(value, sort_keys=True, default=str)

    walk("", cfg.to_dict())
    for setting, path in input_files(cfg):
        flat[setting] = file_digest(path)[:12] if path.is_file() else "missing"
    for name in LAUNCHER_VARIABLES:
        flat[f"{ENVIRONMENT}{name}"] = os.environ.get(name, "(unset)")
    for name, version in versions().items():
        flat[f"{VERSION}{name}"] = version
    return flat


def _settings_digest(settings: dict[str, str], contents: bool) -> str:
    chosen = {k: v for k, v in settings.items() if k.endswith(CONTENTS) == contents}
    return hashlib.sha256(json.dumps(chosen, sort_keys=True).encode()).hexdigest()[:12] if chosen else "-"


def node_report(rank: int, device=None, cfg=None) -> NodeReport:
    fields = {"host": socket.gethostname(), "python": platform.python_version()}
    for name in PACKAGES:
        fields[name], fields[f"{name} path"] = _package(name)
    fields["packtrain source"] = _source_digest()
    # after the imports above, so a package imported here is read from the module it loaded
    fields[RANGES] = "; ".join(tested.findings(tested.found_versions())) or "all inside"
    fields.update(_gpu_fields(device))
    fields.update(fla_cache_fields(fields["fla"], fields["fla path"]))
    settings = config_settings(cfg) if cfg is not None else {}
    if settings:
        fields["config"] = _settings_digest(settings, contents=False)
        fields["data"] = _settings_digest(settings, contents=True)
    report = NodeReport(rank, fields, machine=_machine(), settings=settings)
    apply_test_override(report)
    return report


def _machine() -> int:
    return int(os.environ.get("GROUP_RANK", "0") or 0)


def apply_test_override(report: NodeReport) -> None:
    name, text = node_override(report.rank)
    if text is None:
        return
    for item in text.split(";"):
        key, sep, value = item.partition("=")
        if not sep or key not in report.fields:
            raise ValueError(f"{name}={text!r}: expected field=value with a field of the report "
                             f"({', '.join(report.fields)})")
        report.fields[key] = value
        report.overridden.append(key)


def gather_objects(obj, info) -> list:
    """Every rank's ``obj`` on every rank, in rank order (the process group is already up: init_distributed)."""
    if not info.enabled:
        return [obj]
    import torch.distributed as dist

    out: list = [None] * info.world_size
    dist.all_gather_object(out, obj)
    return out


def _groups(reports: list[NodeReport], name: str) -> list[tuple[str, list[int]]]:
    """[(value, ranks)], the most common value first."""
    by_value: dict[str, list[int]] = {}
    for r in reports:
        by_value.setdefault(r.fields.get(name, "-"), []).append(r.rank)
    return sorted(by_value.items(), key=lambda kv: (-len(kv[1]), kv[1][0]))


def differences(reports: list[NodeReport]) -> dict[str, list[tuple[str, list[int]]]]:
    names = list(dict.fromkeys(n for r in reports for n in r.fields))
    out = {}
    for name in names:
        groups = _groups(reports, name)
        if name not in NOT_COMPARED and len(groups) > 1:
            out[name] = groups
    return out


def rank_list(ranks: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2,5,7-8'."""
    runs, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            runs.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ",".join(runs)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def fla_pinning_note(fields: dict[str, str]) -> str | None:
    """A line for rank 0 when fla will autotune during training (a first full-length backward that autotunes can
    run out of memory inside Triton's benchmark, :mod:`packtrain.ops.fla_tune`)."""
    if fields["fla"] == NOT_INSTALLED or fields["fla"].startswith("import failed"):
        return None
    if fields["FLA_CACHE_MODE"] not in ("default", "always"):
        return (f"note: FLA autotune is not pinned (FLA_CACHE_MODE={fields['FLA_CACHE_MODE']}): Triton will tune "
                "during the first full-length backward; `packtrain pretune-fla CONFIG` pins it")
    if not fields["FLA default configs"][0].isdigit():
        return (f"note: FLA_CACHE_MODE={fields['FLA_CACHE_MODE']} but {fields['FLA_CONFIG_DIR']} has no pinned "
                f"configs ({fields['FLA default configs']}): Triton will tune; run `packtrain pretune-fla CONFIG`")
    return None


def format_table(reports: list[NodeReport]) -> str:
    diff = differences(reports)
    names = list(dict.fromkeys(n for r in reports for n in r.fields))
    rows = []
    for name in names:
        groups = _groups(reports, name)
        mark = "!" if name in diff else " "
        for i, (value, ranks) in enumerate(groups):
            shown = "all" if len(groups) == 1 else rank_list(ranks)
            rows.append((name if i == 0 else "", mark, value, shown))
    width = max(len(r[0]) for r in rows) + 2
    vwidth = max(len(r[2]) for r in rows)
    hosts = len({r.fields["host"] for r in reports})
    verdict = "all identical" if not diff else f"{_count(len(diff), 'field')} differ{'s' * (len(diff) == 1)}, marked !"
    machines = sorted({r.machine for r in reports})
    where = _count(hosts, "host") if len(machines) == 1 else f"{_count(len(machines), 'machine')}, {_count(hosts, 'host')}"
    lines = [f"check-nodes: {_count(len(reports), 'rank')} on {where} ({verdict})"]
    for m in machines if len(machines) > 1 else []:
        mine = [r for r in reports if r.machine == m]
        odd = sorted({name for name in diff for r in mine if r.fields.get(name) != diff[name][0][0]})
        state = f"differs in {', '.join(odd)}" if odd else "as the majority"
        lines.append(f"  machine {m} ({', '.join(sorted({r.fields['host'] for r in mine}))}): ranks "
                     f"{rank_list([r.rank for r in mine])}, {state}")
    lines.append(f"  {'field':<{width}}  {'value':<{vwidth}}  ranks")
    lines += [f"  {n:<{width}}{m} {v:<{vwidth}}  {s}" for n, m, v, s in rows]
    lines.append("  (install folders are compared too: the same version from another folder is another install)")
    for r in reports:
        if r.overridden:
            lines.append(f"  rank {r.rank}: {', '.join(r.overridden)} set by {OVERRIDE_RANK.format(rank=r.rank)}")
    return "\n".join(lines)


def mismatch_error(diff: dict[str, list[tuple[str, list[int]]]]) -> NodeMismatchError:
    lines = [f"ranks differ in what they import, refusing to start ({_count(len(diff), 'field')}):"]
    for name, groups in diff.items():
        sides = "; ".join(f"{value} on rank{'s' if len(ranks) > 1 else ''} {rank_list(ranks)}"
                          for value, ranks in groups)
        lines.append(f"  {name}: {sides}")
    lines.append("make every node import the same installs (the table above; or `packtrain check-nodes CONFIG` "
                 "under the launcher); ops.check_nodes: false skips this check")
    return NodeMismatchError("\n".join(lines), diff)


def config_differences(reports: list[NodeReport]) -> dict[str, list[tuple[str, list[int]]]]:
    """Each config key (or data file) whose value is not the same on every rank: [(value, ranks)], majority first."""
    keys = list(dict.fromkeys(k for r in reports for k in r.settings))
    out = {}
    for key in keys:
        by_value: dict[str, list[int]] = {}
        for r in reports:
            by_value.setdefault(r.settings.get(key, "(not set)"), []).append(r.rank)
        if len(by_value) > 1:
            out[key] = sorted(by_value.items(), key=lambda kv: (-len(kv[1]), kv[1][0]))
    return out


# What each kind of setting differing means, in the order the refusal names them: (is it one, what to do)
_ADVICE = (
    (lambda key: key.startswith(ENVIRONMENT),
     ("the launcher's environment differs between machines (accelerate launch sets it from each machine's "
      "accelerate config file, and packtrain sets model.dtype and train.activation_checkpointing from it): give "
      "every machine the same accelerate config file")),
    (lambda key: key.startswith(VERSION),
     "give every machine the same installs (`packtrain check-nodes CONFIG` under the launcher shows them)"),
    (lambda key: key.endswith(CONTENTS),
     "give every machine the same files (data, tokenizer, chat template, processor, model config)"),
    (lambda key: True, "give every machine the same config file, data and --set options"),
)


def _advice_of(key: str) -> int:
    return next(i for i, (matches, _) in enumerate(_ADVICE) if matches(key))


def _sides(diff: dict[str, list[tuple[str, list[int]]]], keys: list[str], reports: list[NodeReport]) -> list[str]:
    """``key: value on ranks 0-1 (machine 0), other on rank 2 (machine 1)`` for each of ``keys`` (machines named when
    there are several)."""
    machine_of = {r.rank: r.machine for r in reports}
    several = len(set(machine_of.values())) > 1

    def where(ranks: list[int]) -> str:
        text = f"rank{'s' if len(ranks) > 1 else ''} {rank_list(ranks)}"
        if several:
            machines = sorted({machine_of[r] for r in ranks})
            text += f" (machine{'s' if len(machines) > 1 else ''} {rank_list(machines)})"
        return text

    def short(value: str) -> str:
        return value if len(value) <= 60 else value[:57] + "..."

    return [f"{key}: " + ", ".join(f"{short(v)} on {where(ranks)}" for v, ranks in diff[key]) for key in keys]


def config_mismatch_error(diff: dict[str, list[tuple[str, list[int]]]],
                          reports: list[NodeReport]) -> ConfigMismatchError:
    """One line: every differing key (the launcher's environment first, which explains the config keys it sets),
    its values and the ranks (and machines, when there are several) holding each, and what to make the same."""
    keys = sorted(diff, key=_advice_of)  # stable: each kind's keys in their order
    advice = [text for i, (_, text) in enumerate(_ADVICE) if any(_advice_of(key) == i for key in keys)]
    return ConfigMismatchError(
        f"ranks were started with different configs, refusing to start ({_count(len(diff), 'key')}): "
        + "; ".join(_sides(diff, keys, reports)) + "; " + "; ".join(advice), diff)


def check_same_config(cfg, info) -> None:
    """Every rank's resolved config, input files, launcher environment and versions, compared
    (:func:`config_settings`); :class:`ConfigMismatchError` on every rank when any differ. One all-gather, before
    anything is written."""
    if not info.enabled:
        return
    mine = NodeReport(info.rank, {}, machine=_machine(), settings=config_settings(cfg))
    reports = gather_objects(mine, info)
    diff = config_differences(reports)
    if diff:
        raise config_mismatch_error(diff, reports)


def check_same_plan(fingerprint: str, info) -> None:
    """Every rank planned the same packs (``fingerprint``: :func:`packtrain.data.planner.plan_fingerprint`), else a
    :class:`ConfigMismatchError` on every rank. Why: ranks whose plans differ issue different collectives and wait
    for each other until ``ops.collective_timeout``; :func:`check_same_config` compares what makes the plan, and this
    compares the plan itself, whatever made it differ."""
    if not info.enabled:
        return
    gathered = gather_objects((fingerprint, _machine()), info)
    by_value: dict[str, list[int]] = {}
    for rank, (value, _) in enumerate(gathered):
        by_value.setdefault(value, []).append(rank)
    if len(by_value) > 1:
        key = "plan fingerprint"
        diff = {key: sorted(by_value.items(), key=lambda kv: (-len(kv[1]), kv[1][0]))}
        reports = [NodeReport(rank, {}, machine=machine) for rank, (_, machine) in enumerate(gathered)]
        raise ConfigMismatchError(
            f"ranks planned different packs of data.train, refusing to start: {_sides(diff, [key], reports)[0]}; "
            "their configs, files and versions compared equal, so something else tokenizes or plans differently "
            "there (`packtrain plan CONFIG --json` on each machine shows its packs)", diff)


def _config_rows(reports: list[NodeReport], diff: dict) -> None:
    """Each differing config key as a row of the table (``config: optim.lr``), beside the digests."""
    for key in diff:
        for r in reports:
            r.fields[f"config: {key}"] = r.settings.get(key, "(not set)")


def check_nodes(info, log=print, cfg=None) -> list[NodeReport]:
    """Gather, print the table on rank 0, and raise on every rank if anything differs: the config
    (:class:`ConfigMismatchError`, with ``cfg``) first, then what the ranks import (:class:`NodeMismatchError`)."""
    # every rank gets every report, so every rank reaches the same verdict and none is left waiting
    reports = gather_objects(node_report(info.rank, info.device, cfg), info)
    config_diff = config_differences(reports)
    _config_rows(reports, config_diff)
    if info.is_main:
        log(format_table(reports))
    if config_diff:
        raise config_mismatch_error(config_diff, reports)
    diff = differences(reports)
    if diff:
        raise mismatch_error(diff)
    tested.check_versions_of([line for line in reports[0].fields[RANGES].split("; ") if line != "all inside"])
    return reports
