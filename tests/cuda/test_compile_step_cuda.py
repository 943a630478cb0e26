"""The first cuda run on an empty kernel cache: the compile is counted as compile_s, kept out of
prefill_s and decode_s (so out of the rates) and named in the report; a second run with the
same cache compiles nothing worth naming. Each run is its own process (the compiled modules
are cached per process)."""

import json
import os
import subprocess
import sys
from pathlib import Path

from _gpu import require_gpu

require_gpu()

ROOT = Path(__file__).resolve().parents[2]


def _run(model, cache: Path, *extra):
    env = dict(os.environ, CUPY_CACHE_DIR=str(cache))
    cmd = [sys.executable, "-m", "lockstep", "run", "--model", str(model), "--provider", "cuda", "--raw",
           "--max-new-tokens", "4", "--prompt", "hi there", *extra]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_a_fresh_compile_is_its_own_field_and_a_cached_one_is_not_named(tmp_path):
    from core.testing.tiny_model import make_tiny_model, write_byte_tokenizer

    model = write_byte_tokenizer(make_tiny_model(tmp_path / "m", dtype="float16"))
    cache = tmp_path / "kernels"
    first = _run(model, cache, "--json")
    assert first.returncode == 0, first.stderr[-2000:]
    c = json.loads(first.stdout)["counters"]
    assert c["compile_s"] > 1.0  # nvrtc on an empty cache: seconds
    assert c["prefill_s"] < c["compile_s"] and c["decode_s"] < c["compile_s"]
    assert any(cache.iterdir()), "CuPy wrote nothing to CUPY_CACHE_DIR"
    again = _run(model, cache)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "kernels compiled in" not in again.stderr
    fresh = _run(model, tmp_path / "other-kernels")
    assert "kernels compiled in" in fresh.stderr and str(tmp_path / "other-kernels") in fresh.stderr


def test_compiling_ahead_leaves_nothing_for_the_first_run(tmp_path):
    """What `lockstep prepare --target cuda` does once the folder is built (core.compiling.warm)."""
    from core.testing.tiny_model import make_tiny_model, write_byte_tokenizer

    model = write_byte_tokenizer(make_tiny_model(tmp_path / "m", dtype="float16", quant="int4"))
    cache = tmp_path / "kernels"
    warm = subprocess.run([sys.executable, "-c", "import sys, lockstep; from core.compiling import warm; "
                           "print(warm(sys.argv[1], 'cuda'))", str(model)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600, env=dict(os.environ, CUPY_CACHE_DIR=str(cache)))
    assert warm.returncode == 0 and float(warm.stdout) > 1.0, warm.stderr[-2000:]
    run = _run(model, cache, "--json")
    assert run.returncode == 0 and json.loads(run.stdout)["counters"]["compile_s"] < 0.5
