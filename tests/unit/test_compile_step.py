"""A provider's first-use kernel compile is its own step: counted as compile_s, kept out of the
prefill and decode seconds (so out of every rate), in --json apart from prefill, named in the
run's report; the CUDA provider times each kernels/*.cu compile (core/compiling.py)."""

import json
import sys
import time
import types

import pytest

from core import compiling
from core.cli import main
from core.testing.tiny_model import make_tiny_model, write_byte_tokenizer

COMPILE_S = 100.0  # seconds a fake compile adds to the clock (no real waiting)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_byte_tokenizer(make_tiny_model(tmp_path_factory.mktemp("compile") / "m"))


@pytest.fixture
def slow_first_use(monkeypatch):
    """The prefill and the first decode step each 'compile' once: the clock jumps COMPILE_S."""
    import core.session

    offset = [0.0]
    real_clock = time.perf_counter
    monkeypatch.setattr(time, "perf_counter", lambda: real_clock() + offset[0])
    done = set()

    def once(name, real):
        def wrapped(*args, **kwargs):
            if name not in done:
                done.add(name)
                with compiling.compiling(f"{name}.cu", "/cache/kernels"):
                    offset[0] += COMPILE_S
            return real(*args, **kwargs)
        return wrapped

    steps = core.session.steps
    monkeypatch.setattr(steps, "prefill", once("prefill", steps.prefill))  # the Session's prefill
    prompts = steps.prompts  # the engine's row prefill (core.engine.slots)
    monkeypatch.setattr(prompts, "run_prompts", once("prefill", prompts.run_prompts))
    monkeypatch.setattr(steps, "start_read", once("decode", steps.start_read))


def test_compile_seconds_are_their_own_field_and_out_of_the_rates(tiny, capsys, slow_first_use):
    code = main(["run", "--model", str(tiny), "--raw", "--json", "--max-new-tokens", "4", "--prompt", "hi"])
    doc = json.loads(capsys.readouterr().out)
    c = doc["counters"]
    assert code == 0 and c["compile_s"] >= 2 * COMPILE_S
    assert c["prefill_s"] < COMPILE_S / 10 and c["decode_s"] < COMPILE_S / 10  # both compiles kept out
    assert doc["prefill_tokens_per_s"] == pytest.approx(c["prefill_tokens"] / c["prefill_s"])
    assert doc["prefill_tokens_per_s"] > c["prefill_tokens"] / COMPILE_S  # not a compile-sized rate


def test_the_report_names_the_compile_and_where_it_is_cached(tiny, capsys, slow_first_use):
    code = main(["run", "--model", str(tiny), "--raw", "--max-new-tokens", "4", "--prompt", "hi"])
    err = capsys.readouterr().err
    assert code == 0 and "kernels compiled in 200.0 s, not counted in the rates" in err
    assert "cached in /cache/kernels" in err


def test_a_run_without_a_compile_has_no_compile_note(tiny, capsys):
    code = main(["run", "--model", str(tiny), "--raw", "--json", "--max-new-tokens", "4", "--prompt", "hi"])
    assert code == 0 and json.loads(capsys.readouterr().out)["counters"]["compile_s"] == 0.0


def test_listeners_hear_each_compile_only_inside_their_block():
    heard = []
    with compiling.listen(lambda what, cache: heard.append((what, cache))), compiling.compiling("a.cu", "/c"):
        pass
    with compiling.compiling("b.cu", "/c"):
        pass
    assert heard == [("a.cu", "/c")]


def test_the_cuda_provider_times_each_kernel_file_and_names_cupys_cache(monkeypatch, tmp_path):
    """Host-side: the compile (RawModule and its first get_function) runs inside a timed
    compile block named for the .cu file, with CuPy's cache folder; a second ask is cached."""
    from providers.cuda import module

    events = []

    class RawModule:
        def __init__(self, code, options, name_expressions):
            events.append(("build", compiling.seconds()))
            self.names = name_expressions

        def get_function(self, name):
            events.append(("compile", name))

    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(RawModule=RawModule))
    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("LOCKSTEP_CUDA_PDL_TRIGGER", raising=False)
    heard = []
    expressions = ("gpu_hold", "test-only")  # a tuple no launcher uses: a fresh cache entry
    before = compiling.seconds()
    with compiling.listen(lambda what, cache: heard.append((what, cache))):
        first = module._module("timing", expressions)
        again = module._module("timing", expressions)
    assert first is again and heard == [("timing.cu", str(tmp_path))]
    assert [e[0] for e in events] == ["build", "compile"] and events[1] == ("compile", "gpu_hold")
    assert compiling.seconds() > before
    module._module.cache_clear()


def test_warm_runs_the_model_and_returns_the_compile_seconds(tiny, slow_first_use):
    assert compiling.warm(tiny, "cpu_reference") >= 2 * COMPILE_S  # the prefill's and the step's


@pytest.mark.parametrize("usable, flags", [(True, []), (False, []), (True, ["--no-compile"])])
def test_prepare_for_cuda_compiles_ahead_where_a_gpu_is_usable(tiny, capsys, monkeypatch, usable, flags):
    from core.plugins import ProviderError

    warmed = []
    monkeypatch.setattr("core.cli.prepare", lambda *a, **k: tiny)

    def provider(name):
        if not usable:
            raise ProviderError("no GPU here")
        return name

    monkeypatch.setattr("core.plugins.get_provider", provider)
    monkeypatch.setattr(compiling, "warm", lambda path, p: warmed.append((path, p)) or 12.5)
    code = main(["prepare", "--target", "cuda", *flags])
    out = capsys.readouterr()
    assert code == 0 and out.out == f"{tiny}\n"  # stdout: the folder alone, as before
    if flags:
        assert warmed == [] and "cuda kernels" not in out.err
    elif usable:
        assert warmed == [(tiny, "cuda")] and "cuda kernels ready (12.5 s of compiling)" in out.err
    else:
        assert warmed == [] and "cuda kernels not compiled ahead (no GPU here); the first cuda run compiles them" \
            in out.err
