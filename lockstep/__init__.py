"""Lockstep: batch-N decoding of ONNX Runtime GenAI builder models on pluggable providers.

``import lockstep`` is the import name for users and plugins. It offers the public API of
:mod:`core` (``lockstep.run``, ``lockstep.Session``, ``lockstep.hookimpl``, ...) and every
module of ``core`` and ``providers`` under its own name (``lockstep.provider`` is
``core.provider``, ``lockstep.providers.cpu_reference`` is ``providers.cpu_reference``: the same
module objects).

The implementation lives in the packages ``core`` and ``providers``, two common names: a
program started from a folder that holds its own ``core/`` would find that folder first. This
module loads Lockstep's ``core`` and ``providers`` from the folder next to it, by path, before
anything else can, so ``import lockstep`` cannot be shadowed. One process cannot hold two
packages named ``core``: if another ``core`` was imported first, the import fails with an
ImportError naming both.

    >>> import lockstep
    >>> result = lockstep.run("path/to/model", prompts=["Hi"], max_new_tokens=8)
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent.parent
_PACKAGES = ("core", "providers")


def _pin(names: tuple[str, ...]) -> None:
    """Import Lockstep's own packages ``names`` from the folder beside this one, by path."""
    pending = []
    for name in names:
        folder = _HERE / name
        mod = sys.modules.get(name)
        if mod is not None:
            where = Path(getattr(mod, "__file__", None) or "?").resolve().parent
            if where != folder:
                raise ImportError(
                    f"Lockstep needs the package name {name!r}, but {name!r} is already imported from {where}; "
                    f"Lockstep's is {folder}. Rename the other package, or import lockstep before it")
            continue
        spec = importlib.util.spec_from_file_location(name, folder / "__init__.py",
                                                      submodule_search_locations=[str(folder)])
        if spec is None or spec.loader is None:
            raise ImportError(f"Lockstep's package {name!r} is missing from {folder}")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        pending.append((name, spec, mod))
    try:
        for _name, spec, mod in pending:  # both names are claimed before either runs
            spec.loader.exec_module(mod)  # type: ignore[union-attr]
    except BaseException:
        for name, _spec, _mod in pending:
            for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
                del sys.modules[key]
        raise


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``lockstep.X`` is module ``core.X``; ``lockstep.providers[.X]`` is ``providers[.X]``: the
    same module objects (first on ``sys.meta_path``, so no second copy is ever loaded). Modules
    with their own file in this folder (``lockstep.__main__``) are left to the usual finders."""

    @staticmethod
    def target(fullname: str) -> str | None:
        if not fullname.startswith(__name__ + "."):
            return None
        rest = fullname[len(__name__) + 1:]
        own = Path(__file__).resolve().parent / rest.split(".")[0]
        if own.with_suffix(".py").exists() or own.is_dir():
            return None
        return rest if rest == "providers" or rest.startswith("providers.") else "core." + rest

    def find_spec(self, fullname, path=None, target=None):
        real = self.target(fullname)
        if real is None:
            return None
        try:
            spec = importlib.util.find_spec(real)
        except ModuleNotFoundError:
            return None
        if spec is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=spec.submodule_search_locations is not None)

    def create_module(self, spec):
        return importlib.import_module(self.target(spec.name) or "")

    def exec_module(self, module):
        pass


_pin(_PACKAGES)
if not any(isinstance(f, _Alias) for f in sys.meta_path):
    sys.meta_path.insert(0, _Alias())

from core import *  # noqa: E402, F403
from core import __all__, __version__  # noqa: E402, F401
