"""The command line refuses bad values of plan and serve, and unknown flags, with one line and
exit status 2 before any model work (the rest of the command line's refusals: test_cli.py)."""

import pytest

from core.cli import main
from core.testing.tiny_model import make_tiny_model


def run(capsys, *argv):
    code = main(list(argv))
    return code, capsys.readouterr()


def test_serve_port_and_plan_provider_are_refused_before_any_work(capsys, monkeypatch):
    monkeypatch.setattr("core.cli.resolve_model", lambda *a, **k: pytest.fail("model built"))
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--port", "99999"])
    assert exc.value.code == 2 and "must be a port in [0, 65535], got 99999" in capsys.readouterr().err
    code, out = run(capsys, "plan", "smollm2-135m", "--provider", "nosuch")
    assert code == 2 and "unknown provider 'nosuch'" in out.err


def test_plan_refuses_a_context_beyond_the_model_and_defaults_to_at_most_it(tmp_path, capsys):
    folder = make_tiny_model(tmp_path / "m")  # context 128
    code, out = run(capsys, "plan", str(folder), "--provider", "cpu_reference", "--context", "100000")
    assert code == 2 and "--context 100000 is more than the model context of 128 positions" in out.err
    code, out = run(capsys, "plan", str(folder), "--provider", "cpu_reference", "--json")
    assert code == 0 and '"context": 128' in out.out


@pytest.mark.parametrize("value", ["0", "-1", "nan", "fast"])
def test_plan_refuses_a_bandwidth_that_is_not_positive(capsys, monkeypatch, value):
    monkeypatch.setattr("core.cli.resolve_model", lambda *a, **k: pytest.fail("model built"))
    with pytest.raises(SystemExit) as exc:
        main(["plan", "smollm2-135m", "--h2d-gbps", value])
    assert exc.value.code == 2 and "--h2d-gbps: must be a positive number" in capsys.readouterr().err


def test_serve_refuses_a_port_in_use_and_an_empty_api_key_before_any_model_work(capsys, monkeypatch):
    import socket

    pytest.importorskip("fastapi")
    monkeypatch.setattr("core.cli.resolve_model", lambda *a, **k: pytest.fail("model built"))
    monkeypatch.setattr("core.cli.cached_folder", lambda *a, **k: pytest.fail("model looked up"))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, out = run(capsys, "serve", "--port", str(port))
    assert code == 2 and f"cannot listen on 127.0.0.1:{port}" in out.err and "another --port" in out.err
    code, out = run(capsys, "serve", "--host", "256.1.1.1")
    assert code == 2 and "cannot listen on 256.1.1.1:8000" in out.err
    code, out = run(capsys, "serve", "--api-key", "")
    assert code == 2 and "--api-key is empty" in out.err


def test_plan_with_a_provider_that_cannot_start_says_so_in_one_short_title(tmp_path, capsys, monkeypatch):
    from core import plugins

    def unusable(name):
        raise plugins.ProviderError("a long reason " * 20)
    folder = make_tiny_model(tmp_path / "m")
    monkeypatch.setattr(plugins, "get_provider", unusable)
    code, out = run(capsys, "plan", str(folder), "--provider", "cpu_reference")
    assert code == 0 and "provider 'cpu_reference' cannot start here, `lockstep providers` says why" in out.out
    assert "a long reason" not in out.out
    code, out = run(capsys, "plan", str(folder), "--provider", "cpu_reference", "--json")
    assert code == 0 and "a long reason" in out.out  # the JSON keeps the whole reason


def test_serve_takes_the_model_as_model_too_not_as_an_abbreviated_model_name(capsys, monkeypatch):
    """vLLM's `serve --model DIR` once served the default model under the name DIR (argparse read
    --model as an abbreviation of --model-name)."""
    from core.errors import RequestError

    pytest.importorskip("fastapi")
    seen = []

    def resolve(model, provider):
        seen.append(model)
        raise RequestError("resolved")
    monkeypatch.setattr("core.cli._resolve_model", resolve)
    code, out = run(capsys, "serve", "--model", "my-model", "--port", "0")
    assert code == 2 and "resolved" in out.err and seen == ["my-model"]
    code, out = run(capsys, "serve", "a", "--model", "b", "--port", "0")
    assert code == 2 and "two models given: a and --model b" in out.err and seen == ["my-model"]


@pytest.mark.parametrize("argv, hint", [
    (["run", "--prompt", "hi", "--max-tokens", "5"], "--max-tokens 5; did you mean --max-new-tokens?"),
    (["run", "--prompt", "hi", "--top_p", "0.5"], "--top_p 0.5; did you mean --top-p?"),
    (["run", "--prompt", "hi", "--temprature=0.5"], "--temprature=0.5; did you mean --temperature?"),
    (["plan", "--model", "smollm2-135m"], "--model; the model goes first, without --model: lockstep plan MODEL"),
    (["profile", "--model", "m"], "--model; the model goes first, without --model: lockstep profile MODEL"),
    (["run", "--prompt", "hi", "-n", "5"], "-n 5 (see"),  # a flag's value is not a bare prompt
])
def test_an_unknown_flag_gets_the_flag_to_use(capsys, monkeypatch, argv, hint):
    monkeypatch.setattr("core.cli.resolve_model", lambda *a, **k: pytest.fail("model built"))
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "unrecognized arguments: " + hint in err, err
