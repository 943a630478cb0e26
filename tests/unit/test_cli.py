"""The command line refuses bad input with one line on stderr and exit status 2."""

import re

import pytest

from core.cli import main
from core.models.model import load_model
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


def test_the_onnx_file_of_a_builder_folder_points_to_the_folder(tmp_path, capsys):
    """--model FOLDER/model.onnx: the error names the folder to give instead."""
    folder = make_tiny_model(tmp_path / "m")
    code, out = run(capsys, "run", "--model", str(folder / "model.onnx"), "--prompt", "hi")
    assert code == 2 and f"give its folder {folder}" in out.err


def test_error_text_is_printed_verbatim_not_as_markup(tmp_path, capsys):
    code, out = run(capsys, "run", "--model", str(tmp_path / "x[/y]"), "--prompt", "hi")
    assert code == 2 and "x[/y]" in out.err and out.err.count("\n") == 1


def test_a_bare_prompt_gets_a_hint_to_use_the_prompt_flag(capsys, monkeypatch):
    """`lockstep run "text"` (a prompt without --prompt) is refused before any model work, and
    the message shows where a prompt goes; an unknown option alone gets no such hint."""
    monkeypatch.setattr("core.cli.resolve_model", lambda *a, **k: pytest.fail("model built"))
    with pytest.raises(SystemExit) as exc:
        main(["run", "What is the capital of France?"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "unrecognized arguments: What is the capital of France?" in err
    assert "--prompt" in err.split("unrecognized arguments")[1]
    with pytest.raises(SystemExit) as exc:
        main(["run", "--prompt", "hi", "--no-such-flag"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--no-such-flag" in err and "a prompt goes after" not in err


def test_unknown_provider_is_reported_before_any_model_work(capsys, monkeypatch):
    monkeypatch.setattr("core.cli.resolve_model", lambda *a, **k: pytest.fail("model built"))
    code, out = run(capsys, "run", "--provider", "nope", "--prompt", "hi")
    assert code == 2 and "unknown provider 'nope'" in out.err


@pytest.mark.parametrize("argv, message", [
    (["--tokens", "0"], "positive integer"),
    (["--batch-sweep", "1,x"], "comma-separated"),
    (["--batch-sweep", "1,,2"], "comma-separated"),  # an empty item is a typo, not a skip
    (["--threads", "banana"], "--threads: must be a positive integer, got 'banana'"),
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
    # two tables: speed first, then capture and device memory (each header whole, none cut)
    speed, memory = out.out.split("capture and device memory")
    assert "tok/s" in speed and "row0==b1" in speed and "peak MiB" not in speed
    assert "captures" in memory and "peak MiB" in memory and "tok/s" not in memory
    # the memory columns: the weights each once (the tied table too), the KV cache, a workspace
    from core.runtime.runner import Runner

    weights = Runner(str(folder)).weight_bytes
    assert weights < load_model(folder).weight_bytes() + 1024  # no second layout of the tied table
    for r in data["rows"]:
        assert r["weight_device_bytes"] == weights and r["kv_device_bytes"] == r["kv_bytes"] > 0
        assert r["workspace_bytes"] > 0 and r["other_bytes"] is None  # cpu_reference has no peak
    assert data["rows"][1]["workspace_bytes"] > data["rows"][0]["workspace_bytes"]  # batch 3's activations
    # what the run took: the load time, the host's peak RSS; no driver figure on cpu_reference, and
    # the title says so
    assert all(r["load_s"] > 0 and r["host_rss_peak_bytes"] > 0 and r["driver_peak_bytes"] is None
               for r in data["rows"])
    assert "no driver figure" in " ".join(speed.split())
    # the prefill's live node buffers: counted, and three rows' worth of the one row's
    assert 0 < data["rows"][0]["prefill_activation_bytes"] < data["rows"][1]["prefill_activation_bytes"]


def test_a_profile_point_over_the_device_budget_is_refused_and_the_sweep_goes_on(tmp_path, capsys):
    import json

    from core.runtime.runner import Runner

    folder = make_tiny_model(tmp_path / "m")
    budget = Runner(str(folder)).weight_bytes + (256 << 10)  # batch 1's KV fits beside the weights, 64's not
    out_json = tmp_path / "p.json"
    code, out = run(capsys, "profile", str(folder), "--batch-sweep", "1,64", "--tokens", "2", "--warmup", "1",
                    "--context", "32", "--device-budget", str(budget), "--json", str(out_json))
    rows = json.loads(out_json.read_text())["rows"]
    assert code == 0 and [r["batch"] for r in rows] == [1, 64]
    assert rows[0]["tokens_per_s"] > 0 and not rows[0]["refused"]
    assert rows[1]["refused"].startswith("over the budget") and "device budget" in rows[1]["refused"]
    assert "over the budget" in out.out


def test_profile_runs_ahead_by_default_and_says_so(tmp_path, capsys):
    """The default --context (512) is clamped to a smaller model context (the tiny model's 128);
    the title and JSON say whether steps ran ahead; --no-run-ahead runs the synchronous loop to
    the same tokens (row 0 against batch 1 holds either way) and shows device times as well."""
    import json

    folder = make_tiny_model(tmp_path / "m")
    rows = {}
    for flag in ((), ("--no-run-ahead",)):
        out_json = tmp_path / f"p{len(flag)}.json"
        code, out = run(capsys, "profile", str(folder), "--batch-sweep", "1,2", "--tokens", "4", "--warmup", "1",
                        "--json", str(out_json), *flag)
        assert code == 0, out.err
        assert ("no run-ahead" in out.out) == bool(flag)
        rows[bool(flag)] = json.loads(out_json.read_text())["rows"]
    for off, rs in rows.items():
        assert all(r["run_ahead"] is (not off) and r["row0_matches_batch1"] for r in rs)
        assert all(r["capacity"] <= 128 and r["device_ms_p50"] is not None for r in rs)


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
    assert [r["anchor_prefill_ms"] for r in rows] == [1.0, None, None] and "anchor prefill ms" in out.out
    (tmp_path / "bad.json").write_text("{")
    code, out = run(capsys, "profile", str(folder), "--anchor", str(tmp_path / "bad.json"))
    assert code == 2 and "anchor file" in out.err


def _tiny_with_words(folder):
    """The tiny model plus a word-level tokenizer (ids below its vocab of 256)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = make_tiny_model(folder)
    words = ["<unk>", "hi", "there", "name", "a", "color", "sky", "blue"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    return folder


@pytest.fixture(scope="module")
def words_model(tmp_path_factory):
    return _tiny_with_words(tmp_path_factory.mktemp("words") / "m")


def _json_run(capsys, model, *argv):
    import json

    code, out = run(capsys, "run", "--model", str(model), "--raw", "--json", "--max-new-tokens", "3", *argv)
    return code, (json.loads(out.out) if code == 0 else None), out.err


def test_version_names_the_package_and_where_core_is(capsys):
    import core

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    out = capsys.readouterr().out
    assert exc.value.code == 0 and out.startswith(f"lockstep {core.__version__} (") and "core" in out


class _Stdin:
    def __init__(self, data: bytes):
        import io

        self.buffer = io.BytesIO(data)


@pytest.mark.parametrize("data, prompts", [
    (b"hi there\n\nname a color\n", ["hi there", "name a color"]),
    (b'{"prompt": "hi\\nthere"}\n"sky blue"\n', ["hi\nthere", "sky blue"]),
])
def test_prompts_from_stdin_one_per_line_or_jsonl(capsys, monkeypatch, words_model, data, prompts):
    monkeypatch.setattr("sys.stdin", _Stdin(data))
    code, result, _ = _json_run(capsys, words_model, "--prompt", "-")
    assert code == 0 and len(result["rows"]) == len(prompts)
    from core.models.model import load_model

    tok = load_model(words_model).tokenizer
    assert [r["prompt_ids"] for r in result["rows"]] == [tok.encode(p) for p in prompts]


def test_prompt_file_adds_to_the_prompts_given_on_the_command_line(tmp_path, capsys, words_model):
    path = tmp_path / "p.txt"
    path.write_text("sky blue\nname a color\n")
    code, result, _ = _json_run(capsys, words_model, "--prompt", "hi", "--prompt-file", str(path))
    assert code == 0 and [len(r["prompt_ids"]) for r in result["rows"]] == [1, 2, 3]


@pytest.mark.parametrize("content, message", [
    (b'{"prompt": "hi"}\n{broken\n', "line 2 is not JSON"), (b'{"text": 3}\n', 'line 1: expected a JSON string'),
    (b"\xff\xfe hi\n", "is not UTF-8 text"), (b"\n  \n", "holds no prompt")])
def test_bad_prompt_files_are_one_line_errors(tmp_path, capsys, words_model, content, message):
    path = tmp_path / "p.jsonl"
    path.write_bytes(content)
    code, _, err = _json_run(capsys, words_model, "--prompt-file", str(path))
    assert code == 2 and message in err and err.count("\n") == 1


@pytest.mark.parametrize("argv, message", [
    ([], "give a prompt"), (["--prompt-file", "/absent/p.txt"], "prompt file not found"),
    (["--prompt", "-", "--prompt", "-"], "can be given once"), (["--prompt", "\udcff"], "not valid UTF-8")])
def test_missing_or_bad_prompts_are_refused_before_the_model_loads(capsys, monkeypatch, argv, message):
    monkeypatch.setattr("core.cli.resolve_model", lambda *a, **k: pytest.fail("model built"))
    monkeypatch.setattr("sys.stdin", _Stdin(b"hi\n"))
    code, out = run(capsys, "run", *argv)
    assert code == 2 and message in out.err


def test_run_reports_token_rates_and_finish_reasons(capsys, words_model):
    code, result, _ = _json_run(capsys, words_model, "--prompt", "hi there", "--prompt", "sky")
    assert code == 0 and result["prefill_tokens_per_s"] > 0 and result["decode_tokens_per_s"] > 0
    made = sum(len(r["output_ids"]) - 1 for r in result["rows"])
    assert result["decode_tokens_per_s"] == pytest.approx(made / result["counters"]["decode_s"])
    assert all(r["finish_reason"] in ("eos", "length") for r in result["rows"])
    code, out = run(capsys, "run", "--model", str(words_model), "--raw", "--max-new-tokens", "3",
                    "--prompt", "hi there", "--prompt", "sky")
    reasons = [r["finish_reason"] for r in result["rows"]]
    assert code == 0 and "tok/s" in out.err and "prefill 3 tokens" in out.err
    assert f"finish: row 0 {reasons[0]} (" in out.err and f"row 1 {reasons[1]} (" in out.err


def _nan_rows(rows):
    """cpu_reference with the logits of batch rows ``rows`` made NaN before every token choice
    of a batch that has them (the engine's decode steps: slot b is prompt b)."""
    import numpy as np

    from providers.cpu_reference.provider import CpuReferenceProvider

    class NanRows(CpuReferenceProvider):
        def device_argmax(self, logits, positions, result):
            if logits.shape[0] > max(rows):
                logits[list(rows)] = np.nan
            return super().device_argmax(logits, positions, result)

        def device_sample(self, logits, positions, counter, fed, sampling, result):
            if logits.shape[0] > max(rows):
                logits[list(rows)] = np.nan
            return super().device_sample(logits, positions, counter, fed, sampling, result)

    return NanRows()


@pytest.mark.parametrize("rows, code", [((0, 1), 1), ((1,), 0)])
def test_rows_whose_logits_go_non_finite_are_reported_on_stderr(capsys, monkeypatch, words_model, rows, code):
    provider = _nan_rows(rows)
    monkeypatch.setattr("core.plugins.get_provider", lambda _name: provider)
    got, out = run(capsys, "run", "--model", str(words_model), "--raw", "--max-new-tokens", "3",
                   "--prompt", "hi there", "--prompt", "sky")
    assert got == code
    for i in (0, 1):
        assert (f"row {i}: the logits became NaN or infinite" in out.err) == (i in rows)
    assert "Traceback" not in out.err


def test_parity_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["parity", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: 1,2; with --full 1,2,8)" in text and "--full" in text


def test_profile_checks_the_provider_before_building_the_model(capsys, monkeypatch):
    monkeypatch.setattr("core.cli.resolve_model", lambda *a, **k: pytest.fail("model built"))
    code, out = run(capsys, "profile", "smollm2-135m", "--provider", "nope")
    assert code == 2 and "unknown provider 'nope'" in out.err


def test_profile_cuda_without_a_gpu_fails_before_building(capsys, monkeypatch):
    from core.plugins import ProviderError, get_provider

    try:
        get_provider("cuda")
        pytest.skip("a usable GPU is here")
    except ProviderError:
        pass
    monkeypatch.setattr("core.cli.resolve_model", lambda *a, **k: pytest.fail("model built"))
    code, out = run(capsys, "profile", "smollm2-135m", "--provider", "cuda")
    assert code == 2 and "'cuda'" in out.err and out.err.count("\n") == 1


def test_parity_runs_the_quick_mode_by_default_and_says_so(tmp_path, capsys):
    import json

    folder = make_tiny_model(tmp_path / "m", dtype="float16")
    code, out = run(capsys, "parity", "--provider", "cpu_reference", "--model", str(folder), "--json")
    kit = json.loads(out.out)
    assert code == 0 and kit["mode"] == "quick" and kit["passed"]
    tiny, check = kit["reports"]
    assert tiny["mode"] == "quick: tiny model" and tiny["dtype"] == "float16" and tiny["batches"] == [1, 2, 8]
    assert check["mode"] == "quick: short check" and check["model"] == str(folder)
    assert (check["batches"], check["steps"]) == ([1, 2], 4)
    status = {g["name"]: g["status"] for g in check["gates"]}
    assert {k for k, v in status.items() if v == "pass"} == {"logits", "greedy", "batch_invariance", "prompt"}
    assert all(g["detail"] == "not run in this check (quick: short check)" for g in check["gates"]
               if g["status"] == "skip")
    # progress: plain lines on stderr (not a terminal), naming the gate and the batch
    assert "tiny model: logits gate: batch 8" in out.err and "model: greedy gate: batch 2" in out.err


def test_parity_full_mode_runs_every_gate_on_the_model(tmp_path, capsys):
    folder = make_tiny_model(tmp_path / "m")
    code, out = run(capsys, "parity", "--provider", "cpu_reference", "--model", str(folder), "--full",
                    "--steps", "4", "--batch", "1,3")
    assert code == 0 and "parity (full)" in out.out and "mode full: every gate on the model" in out.out
    assert "not run in this check" not in out.out


@pytest.mark.parametrize("argv, message", [
    (["--batch", "100000"], "GiB is available"), (["--steps", "1000"], "the model context is 128")])
def test_parity_refuses_requests_that_cannot_fit_before_any_run(tmp_path, capsys, monkeypatch, argv, message):
    folder = make_tiny_model(tmp_path / "m")
    monkeypatch.setattr("core.runtime.residency.available_host_bytes", lambda: 2**30)
    monkeypatch.setattr("core.testing.parity._decode", lambda *a, **k: pytest.fail("a gate ran"))
    code, out = run(capsys, "parity", "--provider", "cpu_reference", "--model", str(folder), *argv)
    assert code == 2 and message in out.err


@pytest.mark.parametrize("argv", [["--temperature", "-1"], ["--top-p", "0"], ["--top-k", "-3"], ["--min-p", "2"],
                                  ["--repetition-penalty", "0"], ["--seed", "-1"], ["--max-new-tokens", "-1"],
                                  ["--stop", ""], ["--weight-budget", "foo"], ["--device-budget", "10%"],
                                  ["--device-budget", "0.5"], ["--tensor-parallel", "2", "--do-sample"],
                                  ["--tensor-parallel", "2", "--repetition-penalty", "1.2"]])
def test_run_refuses_bad_request_values_before_preparing_the_model(monkeypatch, capsys, argv):
    """A value that needs no model to check is refused (exit 2, one line) before the default
    model is prepared: on a cold cache that would be minutes of building first."""
    import core.cli

    def never(*_args, **_kw):
        raise AssertionError("the model was prepared before the request was checked")

    monkeypatch.setattr(core.cli, "_resolve_model", never)
    code, out = run(capsys, "run", "--prompt", "hi", *argv)
    assert code == 2
    err = out.err
    assert err.startswith("lockstep run: error:") and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("argv, flag", [(["--temperature", "-1"], "--temperature"), (["--top-p", "2"], "--top-p"),
                                        (["--max-new-tokens", "-1"], "--max-new-tokens"),
                                        (["--repetition-penalty", "0"], "--repetition-penalty"),
                                        (["--stop", ""], "--stop")])
def test_a_bad_request_value_is_named_by_its_flag(monkeypatch, capsys, argv, flag):
    """The one-line error names the flag the user typed, not the library's parameter name."""
    import core.cli

    monkeypatch.setattr(core.cli, "_resolve_model", lambda *a, **k: pytest.fail("model prepared"))
    code, out = run(capsys, "run", "--prompt", "hi", *argv)
    assert code == 2 and flag in out.err
    assert re.search(r"(?<!-)" + flag[2:].replace("-", "_"), out.err) is None  # no bare parameter name


def test_a_cached_default_model_is_used_without_a_preparing_line(tmp_path, monkeypatch, capsys):
    """A complete cached variant is returned as is: no "preparing" status line (nothing is
    built), and no build is started."""
    import core.cli
    from core.models.prepare import DEFAULT_MODEL, Variant, write_stamp

    monkeypatch.setenv("LOCKSTEP_CACHE", str(tmp_path))
    variant = Variant(DEFAULT_MODEL, "fp32", "cpu")
    folder = tmp_path / "models" / variant.folder_name
    folder.mkdir(parents=True)
    (folder / "genai_config.json").write_text("{}")
    (folder / "model.onnx").write_bytes(b"")
    write_stamp(folder, variant)

    def never(*_args, **_kw):
        raise AssertionError("a build was started for a cached model")

    monkeypatch.setattr(core.cli, "resolve_model", never)
    assert core.cli._resolve_model(None, "cpu_reference") == folder
    assert "preparing" not in capsys.readouterr().err


def test_a_cached_model_of_an_earlier_recipe_is_prepared_again(tmp_path, monkeypatch, capsys):
    """A cached folder without the current recipe's stamp is not taken as is: the CLI prepares
    (prepare() then rebuilds it) and says so."""
    import core.cli
    from core.models.prepare import DEFAULT_MODEL, Variant

    monkeypatch.setenv("LOCKSTEP_CACHE", str(tmp_path))
    folder = tmp_path / "models" / Variant(DEFAULT_MODEL, "fp32", "cpu").folder_name
    folder.mkdir(parents=True)
    (folder / "genai_config.json").write_text("{}")
    (folder / "model.onnx").write_bytes(b"")
    calls = []
    def rebuild(*a, progress, **k):  # prepare() says why it rebuilds
        calls.append(a)
        progress("rebuilding")
        return folder

    monkeypatch.setattr(core.cli, "resolve_model", rebuild)
    assert core.cli._resolve_model(None, "cpu_reference") == folder
    assert len(calls) == 1 and "preparing the default model" in capsys.readouterr().err


def test_chat_refuses_a_bad_sampling_value_before_preparing_the_model(monkeypatch, capsys):
    """lockstep chat checks its options (named by flag) before it prepares or loads a model."""
    import core.cli

    monkeypatch.setattr(core.cli, "_resolve_model", lambda *a, **k: pytest.fail("model prepared"))
    code, out = run(capsys, "chat", "--temperature", "-1")
    assert code == 2 and "--temperature must be >= 0" in out.err


def test_tensor_tflops_without_kernels_is_refused_before_any_work(tmp_path, capsys, monkeypatch):
    import core.cli

    monkeypatch.setattr(core.cli, "_resolve_model", lambda *a, **k: pytest.fail("model prepared"))
    code, out = run(capsys, "profile", str(tmp_path), "--tensor-tflops", "100")
    assert code == 2 and "--tensor-tflops" in out.err and "--kernels" in out.err


@pytest.mark.parametrize("flags, says", [
    (["--anchor", "missing.json"], "cannot read the anchor file"),
    (["--json", "no/such/folder/out.json"], "its folder does not exist"),
    (["--plot", "no/such/folder/out.png"], "out.png"),  # matplotlib missing, or the folder
])
def test_profile_files_are_checked_before_the_model_is_prepared(tmp_path, capsys, monkeypatch, flags, says):
    """A bad --anchor, --json or --plot is refused before the model is resolved (a named model
    is built on first use: minutes), not after."""
    import core.cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(core.cli, "_resolve_model", lambda *a, **k: pytest.fail("model prepared"))
    code, out = run(capsys, "profile", "smollm2-135m", *flags)
    assert code == 2 and len(out.err.strip().splitlines()) == 1
    assert says in out.err or (flags[0] == "--plot" and "matplotlib" in out.err)


def test_one_row_summary_counts_its_tokens_in_the_singular(capsys, words_model):
    code, out = run(capsys, "run", "--model", str(words_model), "--raw", "--max-new-tokens", "1", "--prompt", "sky")
    summary = next(line for line in out.err.splitlines() if "prefill" in line)
    assert code == 0 and "1 row, 1 token;" in summary and "tokens;" not in summary.split("prefill")[0]


@pytest.mark.parametrize("command", ["run", "profile", "prepare"])
def test_an_unknown_flag_is_one_line_naming_the_commands_help(capsys, command):
    with pytest.raises(SystemExit) as exc:
        main([command, "--bogus-flag"] + (["DIR"] if command == "profile" else []))
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err == (f"lockstep {command}: error: unrecognized arguments: --bogus-flag "
                                           f"(see `lockstep {command} --help`)\n")


def test_a_bad_option_value_is_one_line_like_the_commands_own_checks(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["profile", "DIR", "--tokens", "-1"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and len(err.splitlines()) == 1 and "--tokens" in err and "usage" not in err


def test_tensor_parallel_with_sampling_is_refused_in_flag_terms(monkeypatch, capsys):
    import core.cli

    monkeypatch.setattr(core.cli, "_resolve_model", lambda *a, **k: pytest.fail("model prepared"))
    code, out = run(capsys, "run", "--prompt", "hi", "--tensor-parallel", "2", "--do-sample")
    assert code == 2 and "--tensor-parallel decodes greedily only" in out.err
    assert "drop --do-sample" in out.err and "--no-do-sample" not in out.err  # what was typed, not its opposite


def test_a_closed_stdout_ends_the_command_quietly(monkeypatch, capsys):
    """``lockstep ... | head``: when the reader goes away the command stops with status 0 and
    no traceback (the write that failed raised BrokenPipeError)."""
    import core.cli

    def closed(_args):
        raise BrokenPipeError(32, "Broken pipe")

    dup2 = []
    monkeypatch.setattr(core.cli.os, "dup2", lambda fd, target: dup2.append(target))
    monkeypatch.setattr(core.cli, "cmd_providers", closed)  # build_parser binds it when main runs
    assert core.cli.main(["providers"]) == 0
    assert "Traceback" not in capsys.readouterr().err


def test_chat_refuses_max_new_tokens_past_the_context_once_and_reports_bad_turns(monkeypatch, capsys, words_model,
                                                                                    tmp_path):
    """A --max-new-tokens no turn can fit is refused at start (exit 2, by its flag), not at every
    turn; an undecodable line is reported in plain words, the next line still runs, and the exit
    status is 1 because a turn failed."""
    import io
    import shutil

    code, out = run(capsys, "chat", "--model", str(words_model), "--max-new-tokens", "100000")
    assert code == 2 and "--max-new-tokens=100000 leaves no room" in out.err
    folder = shutil.copytree(words_model, tmp_path / "chat")
    (folder / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }} {% endfor %}")
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\udcff there\nhi there\n\n"))
    code, out = run(capsys, "chat", "--model", str(folder), "--max-new-tokens", "2")
    assert code == 1 and "that line is not valid UTF-8 text; it was not sent" in out.err
    assert out.err.count("error:") == 1  # the second line was answered


def test_an_unknown_flag_before_the_command_is_named(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--bogus"])
    assert exit_.value.code == 2 and "unrecognized arguments: --bogus" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--precision", "int4"], ["--target", "cuda"], ["--force"], ["smollm2-135m-x"]])
def test_prepare_list_refuses_options_it_would_ignore(capsys, argv):
    code, out = run(capsys, "prepare", "--list", *argv)
    assert code == 2 and "--list builds nothing" in out.err and out.out == ""


def test_zero_new_tokens_says_nothing_ran(capsys, words_model):
    code, out = run(capsys, "run", "--model", str(words_model), "--raw", "--max-new-tokens", "0", "--prompt", "sky")
    assert code == 0 and "no tokens asked for (--max-new-tokens 0)" in out.err and "prefill 0" not in out.err


def test_profile_rates_keep_a_decimal_below_100_tok_s():
    from core.profile import _rate

    assert [_rate(3.24), _rate(99.96), _rate(100.4), _rate(12345.6)] == ["3.2", "100.0", "100", "12,346"]


def test_a_run_that_streams_weights_says_so_in_its_report(words_model, capsys, monkeypatch):
    """Text mode: a weight budget that streams weights adds a line with the resident and streamed
    bytes and the host-to-device bytes per token; a run with every weight resident has none."""
    from core.runtime import residency

    monkeypatch.setattr(residency, "SMALL_BYTES", 512)  # the tiny model's matrices are a few KiB
    code, out = run(capsys, "run", "--model", str(words_model), "--raw", "--max-new-tokens", "3", "--prompt", "a b",
                    "--weight-budget", "80%")
    assert code == 0
    line = next(x for x in out.err.splitlines() if x.startswith("weights:"))
    assert re.search(r"[\d.]+ KiB resident, [\d.]+ KiB streamed a step through [\d.]+ KiB of staging; "
                     r"[\d.]+ KiB host-to-device per token, byte hit rate \d+%", line), line
    code, out = run(capsys, "run", "--model", str(words_model), "--raw", "--max-new-tokens", "3", "--prompt", "a b")
    assert code == 0 and "finish:" in out.err and "weights:" not in out.err


@pytest.mark.parametrize("command", [["parity", "--provider", "cpu_reference"], ["profile", "m", "--provider",
                                                                                   "cpu_reference"]])
@pytest.mark.parametrize("argv, message", [
    (["--weight-budget", "abc"], "--weight-budget: cannot read the budget 'abc'"),
    (["--weight-budget", "-1"], "--weight-budget: a budget must be positive"),
])
def test_parity_and_profile_read_the_budget_before_any_work(monkeypatch, capsys, command, argv, message):
    """parity and profile refuse a budget that reads as none before the provider, the model or
    any gate (one line naming the flag), as run does."""
    import core.cli

    monkeypatch.setattr(core.cli, "_resolve_model", lambda *a, **k: pytest.fail("model prepared"))
    monkeypatch.setattr("core.plugins.get_provider", lambda *a, **k: pytest.fail("provider created"))
    code, out = run(capsys, *command, *argv)
    assert code == 2 and message in out.err and len(out.err.strip().splitlines()) == 1


@pytest.mark.parametrize("value, message", [
    ("50%", "--device-budget: a device budget takes bytes (4294967296) or a size (4GiB), not a fraction"),
    ("lots", "--device-budget: cannot read the budget 'lots'; use bytes or a size (4GiB, 512MB)"),
])
def test_a_bad_device_budget_names_its_flag_once_and_offers_sizes(monkeypatch, capsys, value, message):
    import core.cli

    monkeypatch.setattr(core.cli, "_resolve_model", lambda *a, **k: pytest.fail("model prepared"))
    code, out = run(capsys, "run", "--prompt", "hi", "--device-budget", value)
    assert code == 2 and message in out.err and out.err.count("--device-budget") == 1
    assert "fraction (40%" not in out.err


def test_sampling_options_without_do_sample_say_they_change_nothing(capsys, words_model):
    """--temperature / --top-p ... on a greedy request (no --do-sample, a model whose search
    section does not sample): one note on stderr, and the greedy tokens; with --do-sample no note."""
    code, greedy, _ = _json_run(capsys, words_model, "--prompt", "sky")
    code_t, tempered, err = _json_run(capsys, words_model, "--prompt", "sky", "--temperature", "0.7", "--top-p", "0.5")
    assert code == code_t == 0 and "note: --temperature, --top-p apply only with --do-sample" in err
    assert tempered["rows"][0]["output_ids"] == greedy["rows"][0]["output_ids"]
    code, _, err = _json_run(capsys, words_model, "--prompt", "sky", "--temperature", "0.7", "--do-sample",
                             "--seed", "3")
    assert code == 0 and "note:" not in err


def test_bare_lockstep_lists_the_commands(capsys):
    code, out = run(capsys)
    assert code == 2 and all(name in out.err for name in ("run", "chat", "prepare", "parity", "profile"))


def test_plan_prints_its_title_verbatim_and_names_the_budget_a_batch_needs(tmp_path, capsys):
    folder = make_tiny_model(tmp_path / "m[cuda13]")  # brackets Rich would take as markup
    code, out = run(capsys, "plan", str(folder), "--provider", "cpu_reference", "--device-budget", "1024")
    assert code == 0 and "m[cuda13]" in out.out
    assert "needs a device budget of at least" in out.out and "expected tok/s" in out.out  # not cut to 80 columns
    code, out = run(capsys, "plan", str(folder), "--weight-budget", "150%")
    assert code != 0 and "--weight-budget" in out.err and "'150%'" in out.err
