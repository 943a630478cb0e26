"""The guide names what the code offers: every CLI command and option (docs/cli.md), every
environment variable the code reads (docs/configuration.md), every counter (docs/counters.md).
A new option, variable or counter fails here until its page says what it does."""

import argparse
import re
from pathlib import Path

import attrs
import pytest

from core.cli import build_parser
from core.counters import Counters, DeviceMemory

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def _options() -> list[tuple[str, str]]:
    return [(name, opt) for name, parser in _subcommands().items() for action in parser._actions
            for opt in action.option_strings if opt.startswith("--") and opt != "--help"]


def test_every_command_has_its_section():
    text = (DOCS / "cli.md").read_text()
    for name in _subcommands():
        assert f"## `lockstep {name}`" in text, name


@pytest.mark.parametrize("command,option", _options())
def test_every_option_is_in_the_command_line_page(command, option):
    assert re.search(rf"{re.escape(option)}\b", (DOCS / "cli.md").read_text()), (command, option)


def _variables_read() -> set[str]:
    names = set()
    for path in [*ROOT.glob("core/**/*.py"), *ROOT.glob("providers/**/*.py"), *ROOT.glob("lockstep/**/*.py")]:
        names |= set(re.findall(r"[\"'](LOCKSTEP_[A-Z0-9_]+)[\"']", path.read_text()))
    return names


def test_the_scan_finds_the_variables():
    # the scan itself works: the cache root and a cuda switch are found
    assert {"LOCKSTEP_CACHE", "LOCKSTEP_CUDA_PDL"} <= _variables_read()


@pytest.mark.parametrize("name", sorted(_variables_read()))
def test_every_environment_variable_is_in_the_configuration_page(name):
    assert f"`{name}`" in (DOCS / "configuration.md").read_text(), name


@pytest.mark.parametrize("name", [a.name for a in attrs.fields(Counters) if not a.name.startswith("_")]
                         + [a.name for a in attrs.fields(DeviceMemory)])
def test_every_counter_is_in_the_counters_page(name):
    assert f"`{name}`" in (DOCS / "counters.md").read_text(), name


def test_every_page_of_the_navigation_exists():
    nav = re.findall(r":\s*([\w./-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.MULTILINE)
    assert "index.md" in nav
    assert [page for page in nav if not (DOCS / page).is_file()] == []
