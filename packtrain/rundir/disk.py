"""Writes to ``output_dir`` that fail for the disk's sake (full, read-only, no permission) end in one line naming
the path and the cause, not a traceback from whichever library was writing.

Where the failures come from: ``OSError`` with errno ENOSPC / EDQUOT (full) or EACCES / EPERM / EROFS (not
writable) from our own writes; torch.save on a full disk raises ``RuntimeError: [enforce fail at
inline_container.cc:...] ... unexpected pos`` or ``file write failed`` without an errno; safetensors raises its
own error whose text carries the OS message. :func:`check_writable` probes the directory before anything is built,
so a read-only or foreign output_dir fails in a second, not after loading the model.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from packtrain.rundir.checkpoint import checkpoints

FULL = {errno.ENOSPC, errno.EDQUOT}
NOT_WRITABLE = {errno.EACCES, errno.EPERM, errno.EROFS}
FULL_TEXT = ("No space left on device", "StorageFull", "Disk quota exceeded")
TORCH_WRITER = "inline_container.cc"  # torch.save's zip writer; on a full disk it loses bytes without an errno


class OutputDirError(ValueError):
    """output_dir cannot be written: full, read-only or not ours."""


def check_writable(out: Path) -> None:
    """Create ``out`` and write, sync and remove a small probe file in it."""
    out = Path(out)
    problem = _not_a_directory(out)
    if problem is not None:
        raise OutputDirError(f"output_dir {out}: {problem}; choose a directory")
    with output_errors(out):
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-probe-{os.getpid()}"
        try:
            with probe.open("wb") as f:
                f.write(b"\0" * 4096)
                f.flush()
                os.fsync(f.fileno())
        finally:
            probe.unlink(missing_ok=True)


@contextmanager
def left_untouched_if_refused(out: Path) -> Iterator[None]:
    """The folders the block creates for ``out`` (:func:`check_writable` creates them first) are removed again when
    it raises and they are still empty: a run refused before it wrote anything leaves no trace. A folder with
    anything in it stays."""
    out = Path(os.path.abspath(Path(out).expanduser()))
    missing = [p for p in (out, *out.parents) if not (p.exists() or p.is_symlink())]  # deepest first
    try:
        yield
    except BaseException:
        for folder in missing:
            try:
                folder.rmdir()
            except OSError:  # not empty (or gone: another rank removed it)
                if folder.exists():
                    break
        raise


def _blocking_file(folder: Path) -> Path | None:
    """The nearest of ``folder`` and its parents that exists, when it is not a directory (a file, a dangling link):
    what stops ``folder`` from being created. None when nothing does."""
    for f in (folder, *folder.parents):
        if f.exists() or f.is_symlink():
            return None if f.is_dir() else f
    return None


def _what(path: Path) -> str:
    return "a dangling symbolic link" if not path.exists() else "a file"


def _not_a_directory(out: Path) -> str | None:
    """Why ``out`` cannot be a directory (it, or the nearest of its parents that exists, is a file), or None."""
    blocker = _blocking_file(out)
    if blocker is None:
        return None
    return f"is {_what(blocker)}" if blocker == out else f"is under {blocker}, which is {_what(blocker)}"


def check_output_path(path: Path, flag: str, directory: bool) -> None:
    """Before a command does its work: ``path``, the file (or with ``directory`` the folder) it will write, can be
    written there. A folder on the way that is a file, or a file name that is a directory, was a traceback at the
    end of the work (``eval --out``, ``export --merged``, ``bench --out``)."""
    path = Path(path)
    blocker = _blocking_file(path.parent)
    if blocker is not None:
        raise OutputDirError(f"{flag} {path}: cannot be created: {blocker} is {_what(blocker)}")
    if directory and (path.exists() or path.is_symlink()) and not path.is_dir():
        raise OutputDirError(f"{flag} {path}: is {_what(path)}, not a directory")
    if not directory and path.is_dir():
        raise OutputDirError(f"{flag} {path}: is a directory; give a file name")


def config_inputs(cfg, config_path=None) -> list[tuple[str, Path | None]]:
    """What a command reads because of its config: (label, path), a path None where unset."""
    d = cfg.data
    return [("the config", Path(config_path) if config_path is not None else None),
            ("data.train", cfg.resolve_path(d.train)), ("data.eval", cfg.resolve_path(d.eval)),
            ("data.chat_template", cfg.resolve_path(d.chat_template)), ("data.tokenizer", cfg.resolve_path(d.tokenizer)),
            ("data.processor", cfg.resolve_path(d.processor)), ("model.path", cfg.resolve_path(cfg.model.path)),
            ("model.adapter", cfg.resolve_path(cfg.model.adapter))]


def check_not_an_input(path, flag: str, inputs, writes: tuple[str, ...] = ()) -> None:
    """An output that is, or lies inside, one of the command's ``inputs`` ((label, path) pairs) is refused before
    any work: ``eval --out`` equal to ``data.eval`` replaced the eval data by loss lines, and ``--out
    ADAPTER/adapter_config.json`` left an adapter that no longer loads. For an output folder, ``writes`` names what
    the command writes inside it; an input there is refused too. Paths are compared resolved (links followed)."""
    out = Path(os.path.abspath(Path(path).expanduser())).resolve()
    written = [out / name for name in writes]
    for label, source in inputs:
        if source is None:
            continue
        src = Path(os.path.abspath(Path(source).expanduser())).resolve()
        if out == src or src in out.parents:
            where = "is" if out == src else "lies inside"
            raise OutputDirError(f"{flag} {path}: {where} {label} {source}, which this command reads; writing there "
                                 "would overwrite it: choose another path")
        for w in written:
            if src == w or w in src.parents:
                raise OutputDirError(f"{flag} {path}: {label} {source} is where this command writes {w.name}; "
                                     "writing there would overwrite it: move it, or choose another path")


def _under(path, out: Path) -> bool:
    try:
        Path(os.path.abspath(path)).relative_to(os.path.abspath(out))
    except ValueError:
        return False
    return True


def _free_bytes(out: Path) -> int:
    folder = out
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return shutil.disk_usage(folder).free


def describe(e: BaseException, out: Path) -> OutputDirError | None:
    """The one-line error for a failed write under ``out``, or None when ``e`` is not about the disk."""
    out = Path(out)
    text = str(e)
    path = getattr(e, "filename", None) or out
    if isinstance(e, OSError) and getattr(e, "filename", None) is not None and not _under(e.filename, out):
        return None  # another file's error (data, tokenizer, a model path): never blamed on output_dir
    resume = ("; `packtrain train --resume` continues from the last complete checkpoint" if checkpoints(out) else
              "; no checkpoint was written yet: free space and run again")
    if isinstance(e, OSError) and e.errno in NOT_WRITABLE:
        return OutputDirError(f"output_dir {out}: not writable: {path}: {e.strerror}")
    full = (isinstance(e, OSError) and e.errno in FULL) or any(t in text for t in FULL_TEXT)
    if full or (isinstance(e, RuntimeError) and TORCH_WRITER in text and _free_bytes(out) < 2**20):
        return OutputDirError(f"output_dir {out}: no space left on device writing {path} "
                              f"({_free_bytes(out):,} bytes free){resume}")
    if isinstance(e, RuntimeError) and TORCH_WRITER in text:
        first = text.strip().splitlines()[0] if text.strip() else text
        return OutputDirError(f"output_dir {out}: a checkpoint write failed ({first}; "
                              f"{_free_bytes(out):,} bytes free){resume}")
    return None


@contextmanager
def output_errors(out: Path) -> Iterator[None]:
    """Re-raise disk failures inside the block as :class:`OutputDirError`; anything else passes through."""
    try:
        yield
    except OutputDirError:
        raise
    except Exception as e:  # re-raised unchanged unless it is about the disk
        err = describe(e, out)
        if err is None:
            raise
        raise err from None
