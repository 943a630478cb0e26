"""The ``lockstep`` import name: the public API of ``core`` that a user's own ``core/`` or
``providers/`` folder cannot shadow (subprocesses started from such a folder)."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _shadowing_folder(tmp_path: Path) -> Path:
    """A user's project folder with its own ``core`` and ``providers`` packages and a provider
    plugin (entry point ``myplugin`` in a dist-info of its own, importing Lockstep as lockstep)."""
    for name in ("core", "providers"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("USERS_OWN = True\n")
    (tmp_path / "myplugin.py").write_text(textwrap.dedent("""
        from lockstep import ProviderSpec, hookimpl
        from lockstep.providers.cpu_reference.provider import CpuReferenceProvider

        @hookimpl
        def lockstep_providers():
            return [ProviderSpec("mine", CpuReferenceProvider, "cpu_reference under another name")]
    """))
    info = tmp_path / "myplugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: myplugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[lockstep.providers]\nmine = myplugin\n")
    return tmp_path


def _python(folder: Path, code: str) -> subprocess.CompletedProcess:
    # -c puts the current folder first on sys.path (where the user's core/ is); Lockstep comes after
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=folder, env=env,
                          capture_output=True, text=True, timeout=300)


def test_a_users_core_folder_shadows_import_core(tmp_path):
    """Why the name exists: from such a folder, ``import core`` is the user's package."""
    proc = _python(_shadowing_folder(tmp_path), "import core; print(getattr(core, 'USERS_OWN', False))")
    assert proc.returncode == 0 and proc.stdout.strip() == "True"


def test_import_lockstep_is_not_shadowed_and_plugins_load(tmp_path):
    proc = _python(_shadowing_folder(tmp_path), """
        import lockstep
        import core, providers
        from lockstep.provider import ProviderBase
        import lockstep.providers.cpu_reference.ops as ops
        import providers.cpu_reference.ops as same
        from pathlib import Path
        from core.testing.tiny_model import make_tiny_model
        assert not hasattr(core, "USERS_OWN") and not hasattr(providers, "USERS_OWN")
        assert lockstep.run is core.run and ProviderBase is core.provider.ProviderBase and ops is same
        names = lockstep.registry().names()
        assert "mine" in names and "cpu_reference" in names, (names, lockstep.registry().errors)
        folder = make_tiny_model(Path("tiny"))
        out = lockstep.run(folder, provider="mine", input_ids=[[1, 2, 3]], max_new_tokens=3)
        ref = lockstep.run(folder, provider="cpu_reference", input_ids=[[1, 2, 3]], max_new_tokens=3)
        assert out.rows[0].output_ids == ref.rows[0].output_ids
        print("ok")
    """)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().endswith("ok")


def test_python_m_lockstep_runs_the_cli_from_such_a_folder(tmp_path):
    folder = _shadowing_folder(tmp_path)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "lockstep", "providers"], cwd=folder, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "mine" in proc.stdout and "cpu_reference" in proc.stdout


def test_another_core_imported_first_is_an_import_error_naming_both(tmp_path):
    proc = _python(_shadowing_folder(tmp_path), "import core\nimport lockstep")
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: Lockstep needs the package name 'core'")
    assert str(tmp_path / "core") in last and str(ROOT / "core") in last


def test_lockstep_offers_the_public_api_of_core():
    import core
    import lockstep

    assert lockstep.__all__ == core.__all__
    assert all(getattr(lockstep, name) is getattr(core, name) for name in core.__all__)
    import lockstep.session

    assert lockstep.session is sys.modules["core.session"]
    with pytest.raises(ModuleNotFoundError):
        import lockstep.no_such_module  # noqa: F401
