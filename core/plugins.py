"""Provider discovery: load the ``lockstep.providers`` entry points through pluggy.

A plugin that fails to import, offers a name already taken, returns an object missing protocol
members, declares an unsupported protocol version or raises in a hook is recorded as a
:class:`PluginError` naming the plugin and its package; the other providers keep working.

Environment:
    LOCKSTEP_DISABLE_PLUGIN_AUTOLOAD=1: load only Lockstep's built-in providers plus the entry
        points named in LOCKSTEP_PLUGINS (comma-separated entry-point names), for hermetic runs.
"""

from __future__ import annotations

import importlib
import os
from importlib import metadata

import attrs
import pluggy

from core import hookspecs
from core.errors import ProviderError  # noqa: F401 (re-exported)
from core.protocol import PROTOCOL_VERSION, missing_members
from core.provider import with_defaults

BUILTIN = {"cpu_reference": "providers.cpu_reference", "cuda": "providers.cuda"}


@attrs.frozen
class PluginError:
    """A plugin that could not be used: its entry point, package and the reason."""

    plugin: str
    package: str
    reason: str

    def __str__(self) -> str:
        return f"plugin {self.plugin!r} (package {self.package}): {self.reason}"


@attrs.define
class ProviderEntry:
    """A registered provider: its spec plus the plugin and package that offered it."""

    spec: hookspecs.ProviderSpec
    plugin: str
    package: str


class Registry:
    """The providers known to this process, loaded once through pluggy."""

    def __init__(self, autoload: bool | None = None, allow: list[str] | None = None):
        if autoload is None:
            autoload = os.environ.get("LOCKSTEP_DISABLE_PLUGIN_AUTOLOAD", "") not in ("1", "true")
        if allow is None:
            allow = [a.strip() for a in os.environ.get("LOCKSTEP_PLUGINS", "").split(",") if a.strip()]
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.entries: dict[str, ProviderEntry] = {}
        self.errors: list[PluginError] = []
        self._load(autoload, allow)

    def _candidates(self, autoload: bool, allow: list[str]):
        """Built-in plugins first (a third-party plugin cannot take their names), then the others."""
        eps = list(metadata.entry_points(group=hookspecs.ENTRY_POINT_GROUP))
        builtin_eps = {ep.value: ep for ep in eps if ep.value in BUILTIN.values()}
        for name, module in BUILTIN.items():
            ep = builtin_eps.get(module)
            if ep is not None:
                yield name, ep.dist.name if ep.dist is not None else "lockstep", ep.load
            else:  # running from a source tree without install
                yield name, "lockstep", lambda module=module: importlib.import_module(module)
        seen = set(BUILTIN)
        for ep in eps:
            package = ep.dist.name if ep.dist is not None else "?"
            if ep.value in BUILTIN.values() or ep.name in seen or not (autoload or ep.name in allow):
                continue
            seen.add(ep.name)
            yield ep.name, package, ep.load
        if not autoload:
            for name in allow:
                if name not in seen:
                    self.errors.append(PluginError(
                        name, "?", f"named in LOCKSTEP_PLUGINS but no entry point of group "
                                   f"{hookspecs.ENTRY_POINT_GROUP!r} has that name"))

    def _load(self, autoload: bool, allow: list[str]) -> None:
        for plugin, package, load in self._candidates(autoload, allow):
            try:
                obj = load()
            except Exception as exc:  # noqa: BLE001 - any import failure is reported, not fatal
                self.errors.append(PluginError(plugin, package, f"failed to import: {exc!r}"))
                continue
            try:
                self.pm.register(obj, name=plugin)
            except Exception as exc:  # noqa: BLE001 - e.g. hookimpl arguments not in the hookspec
                self.errors.append(PluginError(plugin, package, f"is not a valid lockstep plugin: {exc}"))
                continue
            if not hasattr(obj, "lockstep_providers"):
                self.errors.append(PluginError(plugin, package, "does not implement the hook lockstep_providers"))
                self.pm.unregister(obj)
                continue
            try:
                specs = obj.lockstep_providers()
            except Exception as exc:  # noqa: BLE001
                self.errors.append(PluginError(plugin, package, f"hook lockstep_providers raised {exc!r}"))
                self.pm.unregister(obj)
                continue
            for spec in specs or []:
                if not isinstance(spec, hookspecs.ProviderSpec):
                    self.errors.append(PluginError(
                        plugin, package, f"hook lockstep_providers returned {spec!r}, not a ProviderSpec"))
                    continue
                other = self.entries.get(spec.name)
                if other is not None:
                    self.errors.append(PluginError(
                        plugin, package, f"provider name {spec.name!r} is already registered by "
                        f"plugin {other.plugin!r} (package {other.package}); ignored"))
                    continue
                self.entries[spec.name] = ProviderEntry(spec, plugin, package)

    def names(self) -> list[str]:
        """Registered provider names, sorted."""
        return sorted(self.entries)

    def describe(self) -> str:
        """The available providers and any plugin errors, for error messages."""
        text = ", ".join(self.names()) or "(none)"
        if self.errors:
            text += "; plugins with errors: " + "; ".join(str(e) for e in self.errors)
        return text

    def create(self, name: str):
        """Create provider ``name`` and check it against the protocol.

        Raises:
            ProviderError: unknown name (the message lists the installed providers), the
                factory raised (e.g. no GPU), missing protocol members, or a protocol version
                this core does not speak.
        """
        entry = self.entries.get(name)
        if entry is None:
            raise ProviderError(f"unknown provider {name!r}; installed: {self.describe()}")
        where = f"provider {name!r} (plugin {entry.plugin!r}, package {entry.package})"
        try:
            provider = entry.spec.factory()
        except ProviderError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise ProviderError(f"{where} could not be created: {exc}") from exc
        missing = missing_members(provider)
        if missing:
            raise ProviderError(f"{where} lacks protocol members: {', '.join(missing)}")
        caps = provider.capabilities()
        missing = missing_members(provider, caps)
        if missing:
            raise ProviderError(f"{where} declares graph capture but lacks: {', '.join(missing)}")
        if caps.protocol_version != PROTOCOL_VERSION:
            raise ProviderError(
                f"{where} implements protocol version {caps.protocol_version}; this Lockstep "
                f"supports version {PROTOCOL_VERSION}")
        return with_defaults(provider)


_registry: Registry | None = None


def registry(reload: bool = False) -> Registry:
    """The process-wide provider registry (loaded on first use)."""
    global _registry
    if _registry is None or reload:
        _registry = Registry()
    return _registry


def get_provider(name_or_provider):
    """A provider object from a name (looked up in the registry) or a provider object itself."""
    if isinstance(name_or_provider, str):
        return registry().create(name_or_provider)
    missing = missing_members(name_or_provider)
    if missing:
        raise ProviderError(f"object {name_or_provider!r} is not a provider; lacks {', '.join(missing)}")
    return name_or_provider
