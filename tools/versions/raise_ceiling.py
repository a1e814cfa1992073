"""Move the tested ranges' ceiling to the package index's newest releases: `make ceiling` runs this, then `make
test-ceiling` (the whole suite on exactly those releases).

For every package of packtrain/versions.py's TESTED it asks pip for the newest final release on the index (the same
index `make test-ceiling` installs from, any local cap on torch lifted), writes it into NEWEST, sets the range's
ceiling to the minor release after it (in versions.py and pyproject.toml alike) and dates the reading. Floors stay.
A release the suite then fails on is fixed in packtrain, or pinned back here by hand with the reason in
docs/operations.md ("Versions").

    python tools/versions/raise_ceiling.py [--dry-run]
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VERSIONS, PYPROJECT = REPO / "packtrain" / "versions.py", REPO / "pyproject.toml"


def newest_release(distribution: str) -> str:
    """The newest final release of ``distribution`` that pip sees on the index (pre-releases skipped)."""
    from packaging.version import Version

    env = {**os.environ, "PIP_CONSTRAINT": "/dev/null"}  # a machine's pip cap on torch must not hide a release
    out = subprocess.run([sys.executable, "-m", "pip", "index", "versions", distribution], capture_output=True,
                         text=True, env=env, check=False)
    line = next((x for x in out.stdout.splitlines() if x.startswith("Available versions:")), None)
    if line is None:
        raise SystemExit(f"pip index versions {distribution}: no versions listed ({out.stderr.strip()[:200]})")
    found = [Version(v.strip()) for v in line.split(":", 1)[1].split(",") if v.strip()]
    releases = [v for v in found if not v.is_prerelease and not v.is_devrelease and not v.local]
    return str(max(releases))


def next_minor(version: str) -> str:
    from packaging.version import Version

    v = Version(version)
    return f"{v.major}.{v.minor + 1}"


def rewrite(tested: dict[str, str], today: str, dry_run: bool) -> list[str]:
    """NEWEST, the ceilings and the date in versions.py, the ceilings in pyproject.toml; returns the changes."""
    sys.path.insert(0, str(REPO))
    from packtrain.versions import NEWEST, TESTED

    text, project = VERSIONS.read_text(), PYPROJECT.read_text()
    changes = []
    for distribution, newest in tested.items():
        rng = TESTED[distribution][1]
        ceiling = next_minor(newest)
        if newest != NEWEST[distribution]:
            changes.append(f"{distribution}: newest {NEWEST[distribution]} -> {newest}, range <{rng.ceiling} -> "
                           f"<{ceiling}")
        text = text.replace(f'    "{distribution}": "{NEWEST[distribution]}",', f'    "{distribution}": "{newest}",')
        text = re.sub(rf'("{re.escape(distribution)}": \("[a-z_]+", Range\("{re.escape(rng.floor)}", )"[^"]+"',
                      rf'\g<1>"{ceiling}"', text)
        project = project.replace(f'"{distribution}>={rng.floor},<{rng.ceiling}"',
                                  f'"{distribution}>={rng.floor},<{ceiling}"')
    text = re.sub(r'NEWEST_READ = "[0-9-]+"', f'NEWEST_READ = "{today}"', text)
    if not dry_run:
        VERSIONS.write_text(text)
        PYPROJECT.write_text(project)
    return changes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="print what would change, write nothing")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from packtrain.versions import TESTED

    newest = {}
    for distribution in TESTED:
        newest[distribution] = newest_release(distribution)
        print(f"{distribution:<24} newest on the index: {newest[distribution]}")
    changes = rewrite(newest, datetime.date.today().isoformat(), args.dry_run)
    print("\n".join(changes) if changes else "the ceiling is at the newest releases already")
    if changes and not args.dry_run:
        print("now: make test-ceiling (the whole suite on them); commit versions.py and pyproject.toml if it passes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
