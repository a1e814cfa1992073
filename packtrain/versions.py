"""The dependency versions packtrain is tested on, and the refusal of any other.

packtrain patches transformers' Qwen3.5 code from outside, passes its own cache object through the decoder, relies on
FSDP2's hooks and on fla's kernel signatures. A version outside the tested range does not fail loudly: transformers
5.17 ignores packtrain's cache (its decoder passes ``cache_params=``, 5.24's ``cache=``), so kv_only, frozen,
continuation groups, the walk and generation train or generate wrong without an error. So every command checks what
the process would import against :data:`TESTED` before it does any work, and refuses with one line naming the package,
the version found and the range.

Each range runs from the oldest version the suite has passed on (``make test-floor``: :func:`floor_requirements`) to
below the next minor release, which nobody has tested yet; ``make test`` runs the newest versions inside the ranges.
``pyproject.toml`` states the same ranges (``tests/test_versions.py`` holds them equal).

Qualifying a new version: set ``PACKTRAIN_UNTESTED_VERSIONS=allow`` (the check then prints its findings and goes on),
run ``make test`` and ``make test-floor`` on it, and raise the range here and in ``pyproject.toml``.

Torch-free and import-free: a package not imported yet is read from the install the import would load (the first
folder on ``sys.path`` that holds it, and that folder's ``*.dist-info``), so ``packtrain plan`` pays no import.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path

ALLOW_ENV = "PACKTRAIN_UNTESTED_VERSIONS"


@dataclass(frozen=True)
class Range:
    """``floor <= version < ceiling``: the floor is the oldest release tested, the ceiling the first one not tested.
    A pre-release or development build of the ceiling is outside (it is not a release below it); a local build
    suffix (``2.13.0+cpu``, ``2.11.0+cu130``) is the release it builds."""
    floor: str
    ceiling: str

    def __str__(self) -> str:
        return f">={self.floor},<{self.ceiling}"

    def holds(self, version: str) -> bool:
        from packaging.version import InvalidVersion, Version

        try:
            found = Version(version)
        except InvalidVersion:
            return False
        if found.epoch != 0:  # `1!5.24.0`: another numbering than the releases tested (pip's >= refuses it too)
            return False
        return Version(self.floor) <= Version(found.public) and found.release < Version(self.ceiling).release


# distribution name -> (import name, tested range). The floors are what `make test-floor` installs; each ceiling is the
# minor release after :data:`NEWEST`'s (``tools/raise_ceiling.py`` moves both to the index's newest releases).
TESTED: dict[str, tuple[str, Range]] = {
    "torch": ("torch", Range("2.11.0", "2.16")),  # 2.11: the GPU image's, which cannot be replaced there
    "transformers": ("transformers", Range("5.24.0", "5.26")),  # 5.17 ignores packtrain's cache (above)
    "peft": ("peft", Range("0.21.0", "0.22")),
    "accelerate": ("accelerate", Range("1.15.0", "1.17")),
    "triton": ("triton", Range("3.6.0", "3.10")),  # 3.6: what torch 2.11 pins
    "fla-core": ("fla", Range("0.6.0", "0.7")),  # 0.6: conv gradients and dh0 of short sequences fixed
    "flash-linear-attention": ("fla", Range("0.6.0", "0.7")),
}
# The newest release of each, what `make test-ceiling` installs and the whole suite passes on (read off the package
# index on the date beside it); ``make test`` runs the pinned CPU torch with the newest of the rest that pip picks.
NEWEST_READ = "2026-12-04"
NEWEST: dict[str, str] = {
    "torch": "2.15.0",
    "transformers": "5.25.0",
    "peft": "0.21.2",
    "accelerate": "1.16.0",
    "triton": "3.9.0",
    "fla-core": "0.6.0",
    "flash-linear-attention": "0.6.0",
}
OPTIONAL = ("triton", "fla-core", "flash-linear-attention")  # the `fla` extra: checked where installed


class UntestedVersionError(ValueError):
    """An imported dependency outside :data:`TESTED`; ``findings`` holds one line per package."""

    def __init__(self, findings: list[str]):
        named = [d for d in TESTED if any(f.startswith(f"{d} ") for f in findings)]
        wanted = " ".join(f"'{d}{TESTED[d][1]}'" for d in named)
        super().__init__(f"{'; '.join(findings)}: packtrain is tested only inside these ranges (another version can "
                         f"train wrong without an error); install tested ones (pip install {wanted}), or set "
                         f"{ALLOW_ENV}=allow to run anyway")
        self.findings = findings


def installed_version(distribution: str) -> str | None:
    """The version this process imports of ``distribution``: ``__version__`` of its module where it is imported
    already, else the version recorded beside the folder the import would load (None: not installed)."""
    name = TESTED[distribution][0] if distribution in TESTED else distribution.replace("-", "_")
    module = sys.modules.get(name)
    if module is not None and distribution not in ("fla-core", "flash-linear-attention"):
        version = getattr(module, "__version__", None)
        if version is not None:
            return str(version)
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        return None
    origins = [spec.origin] if spec.origin not in (None, "namespace") else list(spec.submodule_search_locations or [])
    for origin in origins:
        folder = Path(origin).resolve().parent
        if folder.name == name:  # a package: its metadata lies beside its folder
            folder = folder.parent
        for dist in importlib.metadata.distributions(path=[str(folder)]):
            if _canonical(dist.metadata["Name"] or "") == _canonical(distribution):
                return dist.version
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def findings(found: dict[str, str | None]) -> list[str]:
    """One line per package of ``found`` (distribution -> version, None where not installed) outside its range;
    an optional package that is not installed is fine, a required one is a finding."""
    out = []
    for distribution, version in found.items():
        rng = TESTED[distribution][1]
        if version is None:
            if distribution not in OPTIONAL:
                out.append(f"{distribution} is not installed (tested {rng})")
        elif not rng.holds(version):
            out.append(f"{distribution} {version} is outside the tested range {rng}")
    return out


@functools.cache
def found_versions() -> dict[str, str | None]:
    """Every tested package's version as this process imports it (read once per process)."""
    return {distribution: installed_version(distribution) for distribution in TESTED}


def allowed() -> bool:
    return os.environ.get(ALLOW_ENV, "") == "allow"


def check_versions(found: dict[str, str | None] | None = None) -> list[str]:
    """Refuse (:class:`UntestedVersionError`) any version outside :data:`TESTED` (``found``: distribution ->
    version; default: this process's), or with ``PACKTRAIN_UNTESTED_VERSIONS=allow`` print each finding to stderr
    and go on. Returns the findings."""
    return check_versions_of(findings(found_versions() if found is None else found))


def check_versions_of(lines: list[str]) -> list[str]:
    """:func:`check_versions` on findings already made (a launcher's ranks gather theirs)."""
    if lines and not allowed():
        raise UntestedVersionError(lines)
    for line in lines:
        print(f"warning: {line} ({ALLOW_ENV}=allow: running anyway)", file=sys.stderr)
    return lines


def floor_requirements() -> list[str]:
    """``name==floor`` for every tested package: what ``make test-floor`` installs."""
    return [f"{distribution}=={rng.floor}" for distribution, (_, rng) in TESTED.items()]


def newest_requirements() -> list[str]:
    """``name==newest`` for every tested package: what ``make test-ceiling`` installs."""
    return [f"{distribution}=={NEWEST[distribution]}" for distribution in TESTED]


def main(argv: list[str] | None = None) -> int:
    """``python -m packtrain.versions [--floor | --newest | --ranges]``: the floor or the newest pins one per line
    (the Makefile's), or the ranges as pip requirements, or (no flag) this process's findings."""
    args = sys.argv[1:] if argv is None else argv
    if args == ["--floor"]:
        print("\n".join(floor_requirements()))
    elif args == ["--newest"]:
        print("\n".join(newest_requirements()))
    elif args == ["--ranges"]:
        print("\n".join(f"{d}{rng}" for d, (_, rng) in TESTED.items()))
    elif not args:
        found = found_versions()
        for distribution, version in found.items():
            print(f"{distribution:<24} {version or 'not installed':<16} tested {TESTED[distribution][1]}")
        return 1 if findings(found) else 0
    else:
        print("usage: python -m packtrain.versions [--floor | --newest | --ranges]", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
