"""pytest plugin of the Lockstep parity kit (entry point ``pytest11: lockstep``).

``pytest --lockstep-provider NAME [--lockstep-model DIR]`` runs :mod:`core.testing.suite`
against provider NAME (alone when no test paths are given, beside them otherwise):

    --lockstep-model DIR            decode gates on this builder model (default: a tiny random one)
    --lockstep-batches 1,2,8        batch sizes of the decode gates
    --lockstep-steps 64             decode steps of the decode gates
    --lockstep-seed N               base seed of the random inputs (default: fresh, printed)
    --lockstep-include PATTERN      run only kit ids matching a pattern (repeatable)
    --lockstep-exclude PATTERN=WHY  skip matching kit ids, with the reason (repeatable)
    --lockstep-xfail PATTERN=WHY    expect matching kit ids to fail (strict), with the reason

Kit ids: "op/<case>/<dtype>", "argmax/<case>/<dtype>", "advance/decode_advance",
"advance/download_async", "gate/<name>";
patterns are fnmatch patterns. A provider may declare its own exclusions as the optional
attributes ``parity_exclusions`` / ``parity_xfail`` (dicts pattern -> reason). A table of every
kit test (outcome and errors or reason) is printed at the end (in runs without
--lockstep-provider, only when a kit test failed; else one line of counts). Without --lockstep-provider the
plugin does nothing (it is loaded by every pytest run where Lockstep is installed).
"""

from __future__ import annotations

import fnmatch
import os
from pathlib import Path

import pytest

from core.testing.target import KitTarget, Rule

SUITE = Path(__file__).with_name("suite.py")
_RESULTS = pytest.StashKey[dict]()
_TARGET = pytest.StashKey[KitTarget]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("lockstep", "Lockstep parity kit")
    group.addoption("--lockstep-provider", metavar="NAME", help="run the parity kit against provider NAME")
    group.addoption("--lockstep-model", metavar="DIR", help="builder model folder for the decode gates "
                    "(default: a tiny random model built on the fly)")
    group.addoption("--lockstep-batches", default="1,2,8", metavar="LIST", help="decode-gate batch sizes")
    group.addoption("--lockstep-steps", type=int, default=64, metavar="N", help="decode-gate steps")
    group.addoption("--lockstep-seed", type=int, default=None, metavar="N",
                    help="base seed of the random inputs (default: fresh each run)")
    group.addoption("--lockstep-include", action="append", default=[], metavar="PATTERN",
                    help="run only kit ids matching PATTERN (repeatable)")
    group.addoption("--lockstep-exclude", action="append", default=[], metavar="PATTERN=REASON",
                    help="skip kit ids matching PATTERN, with REASON (repeatable)")
    group.addoption("--lockstep-xfail", action="append", default=[], metavar="PATTERN=REASON",
                    help="expect kit ids matching PATTERN to fail, with REASON (repeatable)")


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_RESULTS] = {}
    name = config.getoption("lockstep_provider")
    if not name:
        return
    if config.getoption("lockstep_seed") is None:
        config.option.lockstep_seed = int.from_bytes(os.urandom(4), "little")
    try:
        rules = [Rule.parse(kind, text) for kind in ("exclude", "xfail")
                 for text in config.getoption(f"lockstep_{kind}")]
        batches = tuple(int(b) for b in config.getoption("lockstep_batches").split(","))
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from exc
    from core.plugins import ProviderError, registry

    if name not in registry().names():
        raise pytest.UsageError(f"--lockstep-provider: unknown provider {name!r}; installed: "
                                f"{registry().describe()}")
    try:  # one usage error for a provider that cannot be made here (no GPU), not a failure per test
        registry().create(name)
    except ProviderError as exc:
        raise pytest.UsageError(f"--lockstep-provider {name}: {exc}") from None
    model = config.getoption("lockstep_model")
    config.stash[_TARGET] = KitTarget(name, Path(model) if model else None, batches,
                                      config.getoption("lockstep_steps"), config.getoption("lockstep_seed"),
                                      rules)
    if config.args_source == pytest.Config.ArgsSource.ARGS:
        config.args.append(str(SUITE))
    else:  # no paths given: the kit alone
        config.args[:] = [str(SUITE)]



def pytest_report_header(config: pytest.Config) -> list[str]:
    target = config.stash.get(_TARGET, None)
    if target is None:
        return []
    return [f"lockstep parity kit: provider {target.provider_name}, model "
            f"{target.model_dir or 'tiny random (built on the fly)'}, batches {target.batches}, "
            f"steps {target.steps}, seed {target.seed} (--lockstep-seed {target.seed} to repeat)"]


def _kit_id(item: pytest.Item) -> str | None:
    callspec = getattr(item, "callspec", None)
    if callspec is not None and "kit_id" in callspec.params:
        return callspec.params["kit_id"]
    return {"test_decode_advance": "advance/decode_advance",
            "test_download_async": "advance/download_async"}.get(item.name)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    patterns = config.getoption("lockstep_include")
    if not patterns:
        return
    keep: list[pytest.Item] = []
    drop: list[pytest.Item] = []
    for item in items:
        kit_id = _kit_id(item)
        matched = kit_id is None or any(fnmatch.fnmatchcase(kit_id, p) for p in patterns)
        (keep if matched else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture(scope="session")
def lockstep_target(request: pytest.FixtureRequest) -> KitTarget:
    """The :class:`KitTarget` made from the --lockstep-* options (skips without --lockstep-provider)."""
    target = request.config.stash.get(_TARGET, None)
    if target is None:
        pytest.skip("the parity kit needs --lockstep-provider NAME")
    return target


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call):
    """Keep each kit test's outcome and detail for the summary table."""
    report = yield
    props = dict(item.user_properties)
    kit_id = props.get("lockstep_id")
    if kit_id is None or (report.when != "call" and report.passed):
        return report
    if hasattr(report, "wasxfail"):
        outcome = "xfail"
    else:
        outcome = "error" if report.when != "call" and report.failed else report.outcome
    detail = props.get("lockstep_detail", "")
    if report.failed:
        lines = [line for line in report.longreprtext.strip().splitlines() if line.strip()]
        detail = lines[-1].strip() if lines else detail
    item.config.stash[_RESULTS][item.nodeid] = (props.get("lockstep_provider", "?"), kit_id, outcome, detail)
    return report


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    results = config.stash.get(_RESULTS, {})
    if not results:
        return
    from rich.console import Console
    from rich.table import Table

    title = "lockstep parity kit"
    target = config.stash.get(_TARGET, None)
    if target is not None:
        title += f": {target.provider_name} vs {target.reference_name} (seed {target.seed})"
    table = Table(title=title)
    table.add_column("provider", no_wrap=True)
    table.add_column("kit id", no_wrap=True)
    table.add_column("outcome", no_wrap=True)
    table.add_column("errors / reason", overflow="fold")
    counts: dict[str, int] = {}
    for provider, kit_id, outcome, detail in sorted(results.values()):
        counts[outcome] = counts.get(outcome, 0) + 1
        table.add_row(provider, kit_id, outcome, detail)
    line = ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
    if target is None and set(counts) <= {"passed", "skipped"}:  # the project's own run, all fine
        terminalreporter.write_line(f"lockstep parity kit: {line}")
        return
    console = Console(width=max(140, terminalreporter._tw.fullwidth), color_system=None, force_terminal=False)
    with console.capture() as cap:
        console.print(table)
    terminalreporter.write_sep("=", "lockstep parity kit summary")
    terminalreporter.write(cap.get())
    terminalreporter.write_line(line)
