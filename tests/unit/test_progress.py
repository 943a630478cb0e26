"""Progress a user sees: the prefill phase, the builder's output while it runs (and the Python
API's default report of a build), plain lines in logs, and a profile plot whose title fits."""

import sys

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


def test_run_reporting_passes_each_line_of_the_builder_on(tmp_path):
    script = "import sys; print('reading layer 0'); print('50%\\r100%', flush=True); sys.stderr.write('saved\\n')"
    lines = []
    code, log = prep.run_reporting([sys.executable, "-c", script], {}, lines.append, "model builder")
    assert code == 0 and lines == ["model builder: reading layer 0", "model builder: 50%",
                                   "model builder: 100%", "model builder: saved"]
    assert log.splitlines()[-1] == "saved"
    code, _ = prep.run_reporting([sys.executable, "-c", "raise SystemExit(3)"], {}, lines.append, "x")
    assert code == 3


def test_the_python_api_reports_a_build_on_stderr(capsys):
    prep._status(None, "building smollm2-135m-fp32-cpu")
    assert capsys.readouterr().err == "lockstep prepare: building smollm2-135m-fp32-cpu\n"


def test_a_failing_builder_is_a_prepare_error_with_its_output(tmp_path, monkeypatch, capsys):
    """The builder subprocess fails: PrepareError with the tail of what it printed, which the
    default progress showed on stderr while it ran."""
    hf = tmp_path / "cache" / "hf" / "smollm2-135m"
    hf.mkdir(parents=True)
    monkeypatch.setenv("LOCKSTEP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(prep, "_check_tools", lambda: None)
    monkeypatch.setattr(prep, "_hf_folder", lambda *a, **k: hf)
    real = prep.run_reporting

    def fake_builder(cmd, env, progress, label):
        return real([sys.executable, "-c", "print('Reading decoder layer 0'); raise SystemExit('boom')"],
                    env, progress, label)

    monkeypatch.setattr(prep, "run_reporting", fake_builder)
    with pytest.raises(prep.PrepareError, match="(?s)model builder failed.*Reading decoder layer 0.*boom"):
        prep.prepare(prep.Variant("smollm2-135m", "int4", "cpu"), output=tmp_path / "out")
    err = capsys.readouterr().err
    assert "lockstep prepare: model builder: Reading decoder layer 0" in err
    assert not (tmp_path / "out").exists()


def test_profile_prints_plain_lines_in_a_log(model_dir, capsys):
    code = main(["profile", str(model_dir), "--batch-sweep", "1,2", "--tokens", "2", "--warmup", "1",
                 "--context", "32"])
    err = capsys.readouterr().err
    assert code == 0 and "profile: batch 1 done (1/2)" in err and "profile: batch 2 done (2/2)" in err


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
