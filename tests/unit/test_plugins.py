"""Provider discovery is robust: a broken plugin is named with its package and the reason, and
every other provider keeps working. Entry points are faked by patching
``core.plugins.metadata.entry_points``."""

from __future__ import annotations

import types

import attrs
import pytest

from core import hookimpl, hookspecs
from core.hookspecs import ProviderSpec
from core.plugins import ProviderError, Registry
from core.protocol import PROTOCOL_VERSION, Capabilities
from providers.cpu_reference.provider import CpuReferenceProvider


@attrs.frozen
class FakeDist:
    name: str


@attrs.frozen
class FakeEntryPoint:
    """What Registry reads from an importlib.metadata.EntryPoint."""

    name: str
    value: str
    target: object  # the plugin object, or an exception raised on load
    dist: FakeDist

    def load(self):
        if isinstance(self.target, BaseException):
            raise self.target
        return self.target


def plugin(*specs, hook=None) -> types.SimpleNamespace:
    """A plugin object whose lockstep_providers hook returns ``specs`` (or runs ``hook``)."""
    @hookimpl
    def lockstep_providers():
        return hook() if hook else list(specs)

    return types.SimpleNamespace(lockstep_providers=lockstep_providers)


def entry(name, target, package=None) -> FakeEntryPoint:
    return FakeEntryPoint(name, f"{name}_module", target, FakeDist(package or f"lockstep-{name}"))


@pytest.fixture
def installed(monkeypatch):
    """installed(*entry_points) -> a fresh Registry seeing the built-ins plus these entry points."""
    monkeypatch.delenv("LOCKSTEP_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    monkeypatch.delenv("LOCKSTEP_PLUGINS", raising=False)

    def make(*eps, **kw):
        monkeypatch.setattr("core.plugins.metadata.entry_points", lambda group: list(eps))
        return Registry(**kw)
    return make


class Good(CpuReferenceProvider):
    name = "good"


def test_builtin_providers_register_without_installed_entry_points(installed):
    reg = installed()
    assert "cpu_reference" in reg.names() and not reg.errors
    assert reg.create("cpu_reference").name == "cpu_reference"


def test_plugin_failing_to_import_is_named_and_others_keep_working(installed):
    reg = installed(entry("broken", ImportError("No module named 'torch_xla'"), "lockstep-broken"),
                    entry("good", plugin(ProviderSpec("good", Good))))
    (err,) = reg.errors
    assert (err.plugin, err.package) == ("broken", "lockstep-broken")
    assert "failed to import" in err.reason and "torch_xla" in err.reason
    assert reg.create("good").name == "good"
    with pytest.raises(ProviderError, match=r"unknown provider 'broken'.*plugin 'broken' \(package lockstep-broken\)"
                                            r": failed to import"):
        reg.create("broken")


def test_duplicate_provider_name_names_both_plugins_and_keeps_the_first(installed):
    reg = installed(entry("first", plugin(ProviderSpec("dup", Good)), "pkg-first"),
                    entry("second", plugin(ProviderSpec("dup", CpuReferenceProvider)), "pkg-second"))
    (err,) = reg.errors
    assert err.plugin == "second" and err.package == "pkg-second"
    assert "'dup' is already registered by plugin 'first' (package pkg-first)" in err.reason
    assert reg.entries["dup"].package == "pkg-first"
    assert isinstance(reg.create("dup"), Good)


def test_provider_name_taken_from_a_builtin_is_refused(installed):
    reg = installed(entry("shadow", plugin(ProviderSpec("cpu_reference", Good)), "evil-pkg"))
    assert "already registered by plugin 'cpu_reference'" in reg.errors[0].reason
    assert type(reg.create("cpu_reference")) is CpuReferenceProvider


def test_provider_missing_protocol_members_is_named(installed):
    class Partial:
        name = "partial"

        def capabilities(self):
            return Capabilities()

    reg = installed(entry("partial", plugin(ProviderSpec("partial", Partial)), "lockstep-partial"))
    with pytest.raises(ProviderError) as info:
        reg.create("partial")
    msg = str(info.value)
    assert "plugin 'partial', package lockstep-partial" in msg
    assert "lacks protocol members" in msg and "device_argmax" in msg and "kv_commit" in msg
    assert reg.create("cpu_reference")


def test_provider_claiming_capture_without_capture_members_is_named(installed):
    class ClaimsCapture(CpuReferenceProvider):
        name = "claims"

        def capabilities(self):
            return Capabilities(graph_capture=True)

    reg = installed(entry("claims", plugin(ProviderSpec("claims", ClaimsCapture))))
    with pytest.raises(ProviderError, match="declares graph capture but lacks: begin_capture, end_capture, replay"):
        reg.create("claims")


def test_unsupported_protocol_version_is_refused_with_both_versions(installed):
    class Future(CpuReferenceProvider):
        name = "future"

        def capabilities(self):
            return Capabilities(protocol_version=PROTOCOL_VERSION + 1)

    reg = installed(entry("future", plugin(ProviderSpec("future", Future)), "lockstep-future"))
    with pytest.raises(ProviderError) as info:
        reg.create("future")
    msg = str(info.value)
    assert "package lockstep-future" in msg
    assert f"protocol version {PROTOCOL_VERSION + 1}" in msg and f"supports version {PROTOCOL_VERSION}" in msg


def test_hook_that_raises_is_named_and_others_keep_working(installed):
    def boom():
        raise RuntimeError("no device found")

    reg = installed(entry("raises", plugin(hook=boom), "lockstep-raises"),
                    entry("good", plugin(ProviderSpec("good", Good))))
    (err,) = reg.errors
    assert err.plugin == "raises" and err.package == "lockstep-raises"
    assert "hook lockstep_providers raised" in err.reason and "no device found" in err.reason
    assert "good" in reg.names() and reg.create("good").name == "good"


def test_factory_that_raises_is_named(installed):
    def factory():
        raise OSError("libcudart.so.13: cannot open shared object file")

    reg = installed(entry("gpu", plugin(ProviderSpec("gpu", factory)), "lockstep-gpu"))
    with pytest.raises(ProviderError, match=r"provider 'gpu' \(plugin 'gpu', package lockstep-gpu\) could not be "
                                            r"created: libcudart"):
        reg.create("gpu")


def test_hook_returning_something_else_than_provider_specs_is_named(installed):
    reg = installed(entry("sloppy", plugin("not a spec"), "lockstep-sloppy"))
    (err,) = reg.errors
    assert err.package == "lockstep-sloppy" and "returned 'not a spec', not a ProviderSpec" in err.reason


def test_module_without_the_hook_is_named(installed):
    reg = installed(entry("empty", types.SimpleNamespace(), "lockstep-empty"))
    assert "does not implement the hook lockstep_providers" in reg.errors[0].reason


def test_misspelled_hookimpl_is_named(installed):
    @hookimpl
    def lockstep_provider():  # not a hookspec of the project
        return []

    reg = installed(entry("typo", types.SimpleNamespace(lockstep_provider=lockstep_provider), "lockstep-typo"))
    (err,) = reg.errors
    assert err.plugin == "typo" and "does not implement the hook lockstep_providers" in err.reason


def test_hookimpl_with_arguments_the_hookspec_lacks_is_named(installed):
    @hookimpl
    def lockstep_providers(device):  # the hookspec takes no arguments
        return []

    reg = installed(entry("wrongargs", types.SimpleNamespace(lockstep_providers=lockstep_providers), "pkg-w"))
    (err,) = reg.errors
    assert err.package == "pkg-w" and "not a valid lockstep plugin" in err.reason and "device" in err.reason


def test_unknown_provider_lists_the_available_ones(installed):
    reg = installed(entry("good", plugin(ProviderSpec("good", Good))))
    with pytest.raises(ProviderError, match="unknown provider 'nope'; installed: cpu_reference, cuda, good"):
        reg.create("nope")


def test_disable_autoload_keeps_builtins_and_the_allow_list_only(installed, monkeypatch):
    eps = (entry("good", plugin(ProviderSpec("good", Good))),
           entry("other", plugin(ProviderSpec("other", Good))),
           entry("broken", ImportError("boom")))
    monkeypatch.setenv("LOCKSTEP_DISABLE_PLUGIN_AUTOLOAD", "1")
    reg = installed(*eps)
    assert reg.names() == ["cpu_reference", "cuda"] and not reg.errors
    monkeypatch.setenv("LOCKSTEP_PLUGINS", "good, broken")
    reg = installed(*eps)
    assert "good" in reg.names() and "other" not in reg.names()
    assert [e.plugin for e in reg.errors] == ["broken"]


def test_allow_list_and_autoload_can_be_passed_explicitly(installed):
    eps = (entry("good", plugin(ProviderSpec("good", Good))), entry("other", plugin(ProviderSpec("other", Good))))
    reg = installed(*eps, autoload=False, allow=["other"])
    assert "other" in reg.names() and "good" not in reg.names()


def test_hookspec_module_documents_every_hook():
    hooks = [getattr(hookspecs, n) for n in dir(hookspecs) if n.startswith("lockstep_")]
    assert hooks and all(h.__doc__ and "When:" in h.__doc__ and "Returns:" in h.__doc__ for h in hooks)


def test_unknown_names_in_lockstep_plugins_are_reported(monkeypatch):
    from core.plugins import Registry

    monkeypatch.setenv("LOCKSTEP_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.setenv("LOCKSTEP_PLUGINS", "no_such_plugin")
    reg = Registry()
    assert "cpu_reference" in reg.names()
    assert any(e.plugin == "no_such_plugin" and "LOCKSTEP_PLUGINS" in e.reason for e in reg.errors)
