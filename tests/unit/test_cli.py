"""The command line refuses bad input with one line on stderr and exit status 2."""

import pytest

from core.cli import main
from core.testing.tiny_model import make_tiny_model


def run(capsys, *argv):
    code = main(list(argv))
    return code, capsys.readouterr()


def test_prepare_never_overwrites_a_folder_that_holds_something_else(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("precious")
    code, out = run(capsys, "prepare", "--output", str(tmp_path))
    assert code == 2 and "not empty" in out.err
    assert (tmp_path / "notes.txt").read_text() == "precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_prepare_refuses_a_file_as_output(tmp_path, capsys):
    target = tmp_path / "file.txt"
    target.write_text("x")
    code, out = run(capsys, "prepare", "--output", str(target))
    assert code == 2 and "is a file" in out.err


def test_error_text_is_printed_verbatim_not_as_markup(tmp_path, capsys):
    code, out = run(capsys, "run", "--model", str(tmp_path / "x[/y]"), "--prompt", "hi")
    assert code == 2 and "x[/y]" in out.err and out.err.count("\n") == 1


def test_unknown_provider_is_reported_before_any_model_work(capsys, monkeypatch):
    monkeypatch.setattr("core.cli.resolve_model", lambda *a, **k: pytest.fail("model built"))
    code, out = run(capsys, "run", "--provider", "nope", "--prompt", "hi")
    assert code == 2 and "unknown provider 'nope'" in out.err


@pytest.mark.parametrize("argv, message", [
    (["--tokens", "0"], "positive integer"),
    (["--batch-sweep", "1,x"], "comma-separated"),
])
def test_profile_rejects_bad_numbers_before_the_sweep(tmp_path, capsys, argv, message):
    folder = make_tiny_model(tmp_path / "m")
    with pytest.raises(SystemExit) as exc:
        main(["profile", str(folder), *argv])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_profile_json_into_a_missing_folder_is_refused(tmp_path, capsys):
    folder = make_tiny_model(tmp_path / "m")
    code, out = run(capsys, "profile", str(folder), "--json", str(tmp_path / "absent" / "x.json"))
    assert code == 2 and "folder does not exist" in out.err


def test_profile_sweep_on_cpu_reference_writes_json(tmp_path, capsys):
    import json

    folder = make_tiny_model(tmp_path / "m")
    out_json = tmp_path / "p.json"
    code, out = run(capsys, "profile", str(folder), "--batch-sweep", "1,3", "--tokens", "3",
                    "--warmup", "1", "--context", "32", "--json", str(out_json))
    data = json.loads(out_json.read_text())
    assert code == 0 and [r["batch"] for r in data["rows"]] == [1, 3]
    assert all(r["row0_matches_batch1"] and r["tokens_per_s"] > 0 for r in data["rows"])


def test_profile_sweeps_prompt_lengths_with_a_capacity_per_length(tmp_path, capsys):
    import json

    folder = make_tiny_model(tmp_path / "m")  # context 128
    out_json = tmp_path / "p.json"
    code, out = run(capsys, "profile", str(folder), "--batch-sweep", "1,2", "--tokens", "2", "--warmup", "1",
                    "--context", "32", "--prompt-len", "4,40", "--json", str(out_json))
    rows = json.loads(out_json.read_text())["rows"]
    assert code == 0
    assert [(r["prompt_len"], r["batch"]) for r in rows] == [(4, 1), (4, 2), (40, 1), (40, 2)]
    assert [r["capacity"] for r in rows] == [32, 32, 64, 64]  # 40 + 1 + 2 + 1 rounded up to 64
    assert all(r["row0_matches_batch1"] and r["prefill_ms"] > 0 for r in rows)
    code, out = run(capsys, "profile", str(folder), "--prompt-len", "200", "--tokens", "2")
    assert code == 2 and "model context is 128" in out.err


def test_profile_puts_the_anchor_beside_its_rows(tmp_path, capsys):
    import json

    folder = make_tiny_model(tmp_path / "m")
    anchor = tmp_path / "ort.json"
    anchor.write_text(json.dumps({"anchor": "ort_genai", "rows": [
        {"prompt_len": 4, "batch": 1, "graph": True, "tokens_per_s": 123.0, "prefill_ms": 1.0, "refused": None},
        {"prompt_len": 4, "batch": 2, "graph": False, "tokens_per_s": None, "prefill_ms": None,
         "refused": "batch too large"}]}))
    out_json = tmp_path / "p.json"
    code, out = run(capsys, "profile", str(folder), "--batch-sweep", "1,2,3", "--tokens", "2", "--warmup", "1",
                    "--context", "32", "--prompt-len", "4", "--anchor", str(anchor), "--json", str(out_json))
    rows = json.loads(out_json.read_text())["rows"]
    assert code == 0 and "anchor tok/s" in out.out
    assert [(r["anchor_tokens_per_s"], r["anchor_note"]) for r in rows] == [
        (123.0, "graph"), (None, "refused: batch too large"), (None, "not run")]
    (tmp_path / "bad.json").write_text("{")
    code, out = run(capsys, "profile", str(folder), "--anchor", str(tmp_path / "bad.json"))
    assert code == 2 and "anchor file" in out.err
