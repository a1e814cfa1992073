"""No test lost: every pytest node id collected before a change is collected after it, or maps to one that is, by
the moves in docs/moved_tests.txt (a file moved keeps its tests' names; an id renamed maps alone).

    .venv/bin/python -m pytest --collect-only -q | grep :: > /tmp/before.txt     # on the commit before
    .venv/bin/python -m pytest --collect-only -q | grep :: > /tmp/after.txt      # on the change
    python tools/experiments/node_ids.py /tmp/before.txt /tmp/after.txt

Prints how many ids were kept, moved and added, and every lost id (one an old id maps to that is not collected
after counts as lost, naming its target); exit status 1 when any is lost.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

MOVES = Path(__file__).resolve().parents[2] / "docs" / "moved_tests.txt"


def read_moves(path: Path) -> tuple[dict[str, str], dict[str, str]]:
    """({old file: new file}, {old id: new id}) from lines ``OLD -> NEW`` (a line starting with ``#`` is a comment)."""
    files, ids = {}, {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        old, arrow, new = (part.strip() for part in line.partition(" -> "))
        if not arrow or not old or not new or ("::" in old) != ("::" in new):
            raise SystemExit(f"{path}:{number}: expected 'OLD -> NEW', both files or both node ids: {line!r}")
        (ids if "::" in old else files)[old] = new
    return files, ids


def moved_to(node: str, files: dict[str, str], ids: dict[str, str], now: set[str] | frozenset = frozenset()
             ) -> str | None:
    """Where ``node`` went by the moves, followed from move to move (a file moved, then a test out of it) until one
    that ``now`` collects, or None when no move names it."""
    target, seen = None, {node}
    while target not in now and (step := _one_move(node, files, ids)) is not None and step not in seen:
        target = node = step
        seen.add(step)
    return target


def _one_move(node: str, files: dict[str, str], ids: dict[str, str]) -> str | None:
    if node in ids:
        return ids[node]
    base, bracket, params = node.partition("[")  # a parametrized test moved by its bare name: every parameter
    if bracket and base in ids and "[" not in ids[base]:
        return f"{ids[base]}[{params}"
    file, sep, rest = node.partition("::")
    return f"{files[file]}{sep}{rest}" if file in files else None


def compare(before: list[str], after: list[str], files: dict[str, str], ids: dict[str, str]) -> dict[str, list]:
    now = set(after)
    kept = [n for n in before if n in now]
    moved, lost = [], []
    for node in (n for n in before if n not in now):
        target = moved_to(node, files, ids, now)
        (moved if target in now else lost).append((node, target))
    arrived = {t for _, t in moved} | set(kept)
    return {"kept": kept, "moved": moved, "lost": lost, "added": [n for n in after if n not in arrived]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before", type=Path, help="node ids collected before the change, one a line")
    ap.add_argument("after", type=Path, help="node ids collected after it")
    ap.add_argument("--moves", type=Path, default=MOVES, help="the moves (default: docs/moved_tests.txt)")
    args = ap.parse_args(argv)
    ids_of = lambda p: [x.strip() for x in p.read_text().splitlines() if "::" in x]  # noqa: E731
    result = compare(ids_of(args.before), ids_of(args.after), *read_moves(args.moves))
    print(f"{len(result['kept'])} kept, {len(result['moved'])} moved, {len(result['added'])} added, "
          f"{len(result['lost'])} lost")
    for node, target in result["lost"]:
        print(f"lost: {node}" + (f" (mapped to {target}, not collected)" if target else ""))
    return 1 if result["lost"] else 0


if __name__ == "__main__":
    sys.exit(main())
