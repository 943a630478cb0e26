"""Pluggy hook specifications of the ``lockstep`` project.

Every provider plugin, built-in or third-party, is a module (or object) named by an entry point
in the group ``lockstep.providers`` that implements these hooks with ``@core.hookimpl``.
The built-in providers (``providers.cpu_reference``, ``providers.cuda``) register through the
same group in Lockstep's own ``pyproject.toml``.
"""

from __future__ import annotations

from typing import Any, Callable

import attrs
import pluggy

PROJECT = "lockstep"
ENTRY_POINT_GROUP = "lockstep.providers"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@attrs.frozen
class ProviderSpec:
    """One provider offered by a plugin.

    Attributes:
        name: the name users pass as ``provider=`` (unique across plugins).
        factory: zero-argument callable returning an object that satisfies
            :class:`core.protocol.ExecutionProvider`. Called only when the provider is
            asked for, so a provider whose device libraries are missing costs nothing until then.
        description: one line shown by ``lockstep providers``.
    """

    name: str
    factory: Callable[[], Any]
    description: str = ""


@hookspec
def lockstep_providers() -> list[ProviderSpec]:  # type: ignore[empty-body]  # a hookspec: never run
    """Declare the providers this plugin offers.

    When: once, when the plugin manager loads the plugin (at the first provider lookup).
    Params: none.
    Returns: a list of :class:`ProviderSpec`. Names must be unique across all plugins; a
    duplicate is reported as a plugin error naming both packages and the later one is ignored.
    """
