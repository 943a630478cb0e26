"""Op tables: a provider's kernels as one module per op in a package.

Each op module defines ``OP_TYPE``, optionally ``DOMAIN`` ("" default), ``run(ctx, *inputs)``
returning one entry per node output, and optionally ``supports(node) -> bool`` for attribute
and dtype checks. Modules whose name starts with "_" are helpers. The table is built by
introspecting the package (STYLE.md: the registry comes from the modules, not a hand-kept
list), so adding an op is adding a file.
"""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType

from core.protocol import Kernel, NodeInfo


class OpTable:
    """(domain, op_type) -> op module, for every op module of ``package``.

    ``supports`` and ``kernel`` are what a provider's protocol members of the same names
    usually delegate to.
    """

    def __init__(self, package: ModuleType):
        self.modules: dict[tuple[str, str], ModuleType] = {}
        for info in pkgutil.iter_modules(package.__path__):
            if info.name.startswith("_"):
                continue
            module = importlib.import_module(f"{package.__name__}.{info.name}")
            op_type = getattr(module, "OP_TYPE", None)
            if op_type is not None:
                self.modules[(getattr(module, "DOMAIN", ""), op_type)] = module

    def supports(self, node: NodeInfo) -> bool:
        """True when an op module exists for the node and its ``supports`` (if any) agrees."""
        module = self.modules.get((node.domain, node.op_type))
        if module is None:
            return False
        check = getattr(module, "supports", None)
        return True if check is None else bool(check(node))

    def kernel(self, node: NodeInfo) -> Kernel:
        """The op module's ``run``.

        Raises:
            KeyError: no module for the node's (domain, op_type).
        """
        return self.modules[(node.domain, node.op_type)].run
