"""core and the cpu_reference provider work where CuPy cannot be imported (a CPU-only install).

One subprocess blocks every import of ``cupy`` (and ``cupyx``, ``cupy_backends``) before
anything else runs, even where CuPy is installed, then: imports ``core``, builds the tiny model
and decodes it on cpu_reference with ``core.run``, checks that nothing tried to import CuPy, and
runs ``python -m core providers`` (``lockstep providers``), which must list cuda as unavailable
with the reason instead of crashing.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent('''
    import contextlib, io, json, runpy, sys

    BLOCKED = ("cupy", "cupyx", "cupy_backends")
    attempts = []

    class NoCupy:
        """Meta-path finder that refuses CuPy (recording each attempt), as on a CPU-only install."""

        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                attempts.append(name)
                raise ModuleNotFoundError(f"No module named {name!r} (blocked by test_no_cupy)", name=name)
            return None

    sys.meta_path.insert(0, NoCupy())
    for name in list(sys.modules):
        assert name.split(".")[0] not in BLOCKED, f"{name} imported before the guard"

    import core
    from core.testing.tiny_model import make_tiny_model

    folder = make_tiny_model(sys.argv[1])
    result = core.run(folder, provider="cpu_reference", input_ids=[[1, 2, 3]], max_new_tokens=4)
    row = result.rows[0]
    report = {
        "output_ids": [int(t) for t in row.output_ids], "finish_reason": row.finish_reason,
        "provider": str(result.provider),
        "attempts_during_decode": list(attempts),
        "cupy_modules": sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED and sys.modules[m] is not None),
    }

    out = io.StringIO()
    sys.argv = ["lockstep", "providers"]
    with contextlib.redirect_stdout(out):
        try:
            runpy.run_module("core", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exc:
            code = exc.code
    report["providers_exit"] = code
    report["providers_out"] = out.getvalue()
    from core.plugins import registry
    try:
        registry().create("cuda")
        report["cuda_error"] = None
    except Exception as exc:
        report["cuda_error"] = f"{type(exc).__name__}: {exc}"
    report["cupy_modules_at_end"] = sorted(
        m for m in sys.modules if m.split(".")[0] in BLOCKED and sys.modules[m] is not None)
    print("REPORT " + json.dumps(report))
''')


def test_core_and_cpu_reference_work_without_cupy(tmp_path):
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "tiny")], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT ")]
    assert len(lines) == 1, proc.stdout + proc.stderr
    report = json.loads(lines[0][len("REPORT "):])

    # decode on cpu_reference: succeeded, and never even tried to import CuPy
    assert report["finish_reason"] in ("length", "eos"), report
    assert 1 <= len(report["output_ids"]) <= 4, report
    assert report["finish_reason"] == "eos" or len(report["output_ids"]) == 4, report
    assert report["attempts_during_decode"] == [], report
    assert report["cupy_modules"] == [] and report["cupy_modules_at_end"] == [], report

    # `lockstep providers`: lists cuda as unavailable with the reason, exits 0, no traceback
    assert report["providers_exit"] in (0, None), report
    out = report["providers_out"]
    assert "Traceback" not in out and "Traceback" not in proc.stderr, proc.stderr
    capabilities = _capabilities(out)
    assert set(capabilities) >= {"cpu_reference", "cuda"}, out
    assert not capabilities["cpu_reference"].startswith("unavailable"), out
    assert capabilities["cuda"].startswith("unavailable:") and "needs CuPy" in capabilities["cuda"], out
    # the full message, as the registry gives it
    error = report["cuda_error"]
    assert error is not None and error.startswith("ProviderError:"), report
    assert "needs CuPy" in error and ".[cuda12]" in error and "lockstep[cuda13]" in error, error


def _capabilities(table: str) -> dict[str, str]:
    """provider -> its "capabilities" cell of the rich table, the lines a wrapped cell spans joined."""
    cells: dict[str, list[str]] = {}
    name = None
    for line in table.splitlines():
        if not line.startswith("│"):
            continue
        columns = [c.strip() for c in line.strip("│").split("│")]
        if columns[0]:
            name = columns[0]
        if name is not None and len(columns) > 2 and columns[2]:
            cells.setdefault(name, []).append(columns[2])
    return {k: " ".join(v) for k, v in cells.items()}
