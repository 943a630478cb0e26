"""Progress a user sees: the prefill phase, the builder's output while it runs (and the Python
API's default report of a build), plain lines in logs, and a profile plot whose title fits."""

import pytest

import core
from core.cli import main
from core.models import prepare as prep
from core.testing.tiny_model import make_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


def test_core_run_reports_the_prefill_before_any_token(model_dir):
    calls = []
    core.run(model_dir, input_ids=[[1, 2, 3], [4]], max_new_tokens=3, progress=lambda d, t: calls.append((d, t)))
    assert calls == [(0, 3), (1, 3), (2, 3), (3, 3)]


def _fake_build(monkeypatch, tmp_path):
    """prepare() with the build steps replaced: the "builder" prints one line and writes a model."""
    monkeypatch.setenv("LOCKSTEP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(prep, "_check_tools", lambda gguf: None)
    monkeypatch.setattr(prep, "_named_gguf", lambda model, root, progress: tmp_path / "x.gguf")
    hf = tmp_path / "hf"
    hf.mkdir(exist_ok=True)
    (hf / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')  # checked before the build
    monkeypatch.setattr(prep, "_gguf_to_hf", lambda gguf, out, progress: hf)

    def builder(hf, tmp, variant, root, progress):
        prep._status(progress, "builder: Reading decoder layer 0")
        make_tiny_model(tmp)

    monkeypatch.setattr(prep, "_run_builder", builder)


def test_the_python_api_reports_a_build_on_stderr_and_a_cached_model_quietly(tmp_path, monkeypatch, capsys):
    _fake_build(monkeypatch, tmp_path)
    out = prep.prepare(prep.Variant("smollm2-135m", "int4", "cpu"))
    err = capsys.readouterr().err.splitlines()
    assert err == ["lockstep prepare: building smollm2-135m-int4-cpu with the ONNX Runtime GenAI model builder",
                   "lockstep prepare: builder: Reading decoder layer 0"]
    assert prep.prepare(prep.Variant("smollm2-135m", "int4", "cpu")) == out
    assert capsys.readouterr().err == ""  # cached: nothing to report
    lines: list[str] = []
    prep.prepare(prep.Variant("smollm2-135m", "int4", "cpu"), progress=lines.append, force=True)
    assert lines[-1] == "builder: Reading decoder layer 0" and capsys.readouterr().err == ""


def test_profile_prints_plain_lines_in_a_log(model_dir, capsys):
    code = main(["profile", str(model_dir), "--batch-sweep", "1,2", "--tokens", "2", "--warmup", "1",
                 "--context", "32"])
    err = capsys.readouterr().err
    assert code == 0 and "profile: batch 1 x 16 prompt tokens done (1/2)" in err
    assert "profile: batch 2 x 16 prompt tokens done (2/2)" in err


def test_the_profile_plot_title_fits_the_figure(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from core.profile import batch_axes

    title = ("/home/someone/.cache/lockstep/models/smollm2-135m-fp32-cpu-a-long-folder-name on cpu_reference, "
             "head_major, capture when supported, context 512")
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([1, 2, 4], [10, 20, 40])
    batch_axes(ax, title)
    fig.tight_layout()
    fig.canvas.draw()
    box, page = ax.title.get_window_extent(), fig.bbox
    assert page.x0 <= box.x0 and box.x1 <= page.x1 and box.y1 <= page.y1
    assert "".join(ax.title.get_text().split()) == "".join(title.split())  # all of it, wrapped
    plt.close(fig)


def test_a_sweep_point_out_of_memory_is_reported_and_the_sweep_goes_on(model_dir, capsys, monkeypatch):
    """Batch 2 runs out of device memory (simulated): its row says so, batches 1 and 3 still run,
    and the pooled decode states are dropped between points."""
    import json

    from core import profile as prof

    real = prof._stream
    seen = []

    def stream(runner, batch, *a, **kw):
        seen.append(len(runner._free))
        if batch == 2:
            raise MemoryError("Out of memory allocating 503,316,480 bytes")
        return real(runner, batch, *a, **kw)

    monkeypatch.setattr(prof, "_stream", stream)
    out = model_dir.parent / "sweep.json"
    code = main(["profile", str(model_dir), "--batch-sweep", "1,2,3", "--tokens", "2", "--warmup", "1",
                 "--context", "32", "--json", str(out)])
    text = capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    assert code == 0 and [r["batch"] for r in rows] == [1, 2, 3]
    assert rows[1]["refused"].startswith("out of memory") and rows[1]["tokens_per_s"] == 0.0
    assert rows[1]["row0_matches_batch1"] is None  # it did not run: no claim either way
    assert rows[0]["tokens_per_s"] > 0 and rows[2]["tokens_per_s"] > 0
    assert "out of memory" in text
    assert seen == [0, 0, 0]


def test_a_sweep_point_too_large_for_memory_is_refused_before_it_runs(model_dir, capsys, monkeypatch):
    """A batch whose KV cache cannot fit the memory available (here: the host's, reported as
    1 MiB) is refused before any of its work, named with the estimate; when every point is
    refused the exit status is 1 (nothing was measured)."""
    import json

    from core import profile as prof
    from core.runtime import residency

    monkeypatch.setattr(residency, "available_host_bytes", lambda: 1 << 20)
    ran = []
    real = prof._stream

    def stream(runner, batch, *a, **kw):
        ran.append(batch)
        return real(runner, batch, *a, **kw)

    monkeypatch.setattr(prof, "_stream", stream)
    out = model_dir.parent / "refused.json"
    code = main(["profile", str(model_dir), "--batch-sweep", "100000", "--tokens", "2", "--warmup", "1",
                 "--context", "32", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert code == 1 and ran == []
    assert rows[0]["refused"].startswith("out of memory (needs ~") and "the host has" in rows[0]["refused"]
    assert rows[0]["row0_matches_batch1"] is None
    assert "out of memory" in capsys.readouterr().out


def test_builder_lines_are_sorted_into_routine_kinds():
    """The builder's output lines: INFO logs and progress bars are thinned, its list of every
    precision/provider pair is never shown (it names pairs Lockstep does not offer), anything
    else is shown as it comes."""
    assert prep._routine("2026-12-02 04:20:46,591 onnxruntime.quantization [INFO] - quantizing") == "info"
    assert prep._routine("Loading weights:  42%|████▏     | 115/272 [00:01<00:01, 99.1it/s]") == "bar"
    assert prep._routine("Valid precision + execution provider combinations are: FP32 CPU, INT8 CPU") == "quiet"
    assert prep._routine("Reading decoder layer 0") is None


def test_the_builders_quiet_lines_reach_the_error_tail_but_not_the_progress(tmp_path, monkeypatch):
    """_run_builder passes the builder's ordinary lines on to the progress callback and never
    its list of every precision/provider pair; a failing build still shows that line in the
    error's tail (the whole log but the bars' redraws)."""
    import sys

    script = ("import sys, pathlib\n"
              "print('Valid precision + execution provider combinations are: FP32 CPU, INT8 CPU')\n"
              "print('Reading decoder layer 0')\n"
              "out = pathlib.Path(sys.argv[sys.argv.index('-o') + 1]); out.mkdir(parents=True, exist_ok=True)\n"
              "if '--fail' not in sys.argv: (out / 'model.onnx').write_bytes(b'')\n")
    variant = prep.Variant("smollm2-135m", "fp32", "cpu")
    shown: list[str] = []
    monkeypatch.setattr(prep, "BUILDER_COMMAND", (sys.executable, "-c", script))
    prep._run_builder(tmp_path / "hf", tmp_path / "out", variant, tmp_path, shown.append)
    assert shown == ["builder: Reading decoder layer 0"]
    monkeypatch.setattr(prep, "BUILDER_COMMAND", (sys.executable, "-c", script, "--fail"))
    with pytest.raises(prep.PrepareError, match="Valid precision"):
        prep._run_builder(tmp_path / "hf", tmp_path / "out2", variant, tmp_path, shown.append)
