"""A run's ``--set`` overrides, recorded in ``OUTPUT/overrides.json`` so that ``train CONFIG --resume`` continues the
run as it was started.

Without the record, a resume typed without the first run's ``--set train.max_steps=18`` would train the config's
own number of steps: another job under the old run's name. With it, a resume applies the recorded overrides first
and the ones given again on its own command line after them (a key given again takes the new value, which the
resume's comparison then allows or refuses like any changed key). The run header lists both, and the record is
written again with the result, for the next resume.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from packtrain.rundir.directory import RunDirError

FILE = "overrides.json"


def key_of(override: str) -> str:
    """``section.key`` of ``section.key=value``."""
    return override.split("=", 1)[0].strip()


@dataclass
class RunOverrides:
    """``kept``: recorded by the run and not given again; ``given``: on this command line."""
    kept: list[str] = field(default_factory=list)
    given: list[str] = field(default_factory=list)

    @property
    def all(self) -> list[str]:
        return self.kept + self.given

    def describe(self) -> str | None:
        """The header's line, None when there are none."""
        parts = [f"{o} (kept from the run's start)" for o in self.kept] + [f"{o} (given now)" for o in self.given]
        return f"--set {', '.join(parts)}" if parts else None


def read(out: Path) -> list[str]:
    """The overrides recorded in ``out``; [] without a record (a new run, or one written before the record)."""
    path = Path(out) / FILE
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    except OSError as e:
        raise RunDirError(f"{path}: cannot be read: {e.strerror}") from None
    try:
        recorded = json.loads(text)
    except ValueError as e:
        raise RunDirError(f"{path}: not valid JSON ({e}); it records the run's --set overrides: fix it, or remove "
                          "it and give them again") from None
    if not (isinstance(recorded, list) and all(isinstance(o, str) and "=" in o for o in recorded)):
        raise RunDirError(f"{path}: expected a list of \"section.key=value\" strings (the run's --set overrides)")
    return recorded


def combine(recorded: list[str], given: list[str]) -> RunOverrides:
    """The recorded overrides whose key is not given again, then the given ones."""
    again = {key_of(o) for o in given}
    return RunOverrides([o for o in recorded if key_of(o) not in again], list(given))


def write(out: Path, overrides: RunOverrides) -> None:
    """Record ``overrides.all`` (atomically: a temporary, then a rename)."""
    path = Path(out) / FILE
    tmp = path.with_name(f".tmp-{FILE}")
    tmp.write_text(json.dumps(overrides.all, indent=1) + "\n")
    os.replace(tmp, path)
