"""Errors say how to fix things: a damaged cached model names its folder and the prepare
command that rebuilds it; a request past the context names the flag, the prompt's tokens and
the largest value that fits; an unsupported architecture is refused before any build with the
supported families; CLI wording counts prompts from 1 and names what the user typed."""

import json
import shutil

import pytest

import core
from core.cli import main
from core.models.prepare import STAMP, PrepareError, Variant, prepare, write_stamp
from core.session import RequestError, Session
from core.testing.tiny_model import make_tiny_model, write_byte_tokenizer

REBUILD = "lockstep prepare smollm2-135m --precision fp32 --target cpu --force"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_byte_tokenizer(make_tiny_model(tmp_path_factory.mktemp("hints") / "m"))


def _cached(tiny, tmp_path, monkeypatch):
    """The tiny model as the cache's smollm2-135m fp32/cpu folder (stamped as prepare writes it)."""
    monkeypatch.setenv("LOCKSTEP_CACHE", str(tmp_path / "cache"))
    folder = shutil.copytree(tiny, tmp_path / "cache" / "models" / "smollm2-135m-fp32-cpu")
    write_stamp(folder, Variant())
    return folder


def _err(capsys, *argv):
    code = main(list(argv))
    return code, capsys.readouterr().err


def test_a_damaged_cached_model_names_its_folder_and_the_rebuild_command(tiny, tmp_path, monkeypatch, capsys):
    folder = _cached(tiny, tmp_path, monkeypatch)
    data = (folder / "model.onnx").read_bytes()
    (folder / "model.onnx").write_bytes(data[: len(data) // 2])  # an interrupted copy
    code, err = _err(capsys, "run", "--prompt", "hi")
    assert code == 2 and f"the model folder {folder} is damaged" in err and err.rstrip().endswith(REBUILD)


def test_outside_the_cache_the_rebuild_command_names_the_folder(tiny, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LOCKSTEP_CACHE", str(tmp_path / "cache"))
    folder = shutil.copytree(tiny, tmp_path / "mine")
    write_stamp(folder, Variant())
    (folder / "model.onnx").write_bytes(b"")
    code, err = _err(capsys, "run", "--model", str(folder), "--prompt", "hi")
    assert code == 2 and f"--output {folder} --force" in err
    (folder / STAMP).unlink()  # not built by Lockstep: no command to offer
    code, err = _err(capsys, "run", "--model", str(folder), "--prompt", "hi")
    assert code == 2 and "build or copy the folder again" in err


def test_a_cached_folder_that_lost_its_model_is_rebuilt_not_refused(tiny, tmp_path, monkeypatch):
    """What the rebuild hint's command meets when model.onnx is gone: a rebuild, not "not empty"."""
    import core.models.prepare as p

    folder = _cached(tiny, tmp_path, monkeypatch)
    (folder / "model.onnx").unlink()
    monkeypatch.setattr(p, "_check_tools", lambda gguf: None)
    monkeypatch.setattr(p, "_named_gguf", lambda *a: tmp_path / "x.gguf")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    monkeypatch.setattr(p, "_gguf_to_hf", lambda *a: hf)
    monkeypatch.setattr(p, "_run_builder", lambda hf, tmp, *a: make_tiny_model(tmp))
    lines: list[str] = []
    assert prepare(Variant(), progress=lines.append) == folder and (folder / "model.onnx").is_file()
    assert any("holds no complete model; rebuilding" in line for line in lines)


def test_max_new_tokens_past_the_context_names_the_largest_that_fits(tiny, capsys):
    argv = ["run", "--model", str(tiny), "--raw", "--json", "--prompt", "hi there"]
    code, err = _err(capsys, *argv, "--max-new-tokens", "1000000000")
    prompt_tokens = len(core.load_model(tiny).tokenizer.encode("hi there"))
    largest = 128 - prompt_tokens + 1  # the tiny model's context is 128
    assert code == 2 and (f"the prompt has {prompt_tokens} tokens and the model context is 128 positions, so "
                          f"--max-new-tokens can be at most {largest}") in err
    assert main(argv + ["--max-new-tokens", str(largest)]) == 0  # the value named fits
    capsys.readouterr()
    assert _err(capsys, *argv, "--max-new-tokens", str(largest + 1))[0] == 2


def test_a_prompt_longer_than_the_context_is_named_from_1(tiny, capsys):
    code, err = _err(capsys, "run", "--model", str(tiny), "--raw", "--prompt", "hi", "--prompt", "x" * 300)
    assert code == 2 and "prompt 2 of 2 has 300 tokens, more than the model context of 128 positions" in err


@pytest.mark.parametrize("argv, message", [
    (["--prompt", " "], "error: the prompt is empty"),
    (["--prompt", "hi", "--prompt", " "], "error: prompt 2 of 2 is empty"),
    (["--prompt", "hi", "--stop", ""], "--stop must not be an empty string"),
    (["--prompt", "hi", "--tensor-parallel", "2", "--do-sample"], "greedily only (no sampler over vocab-sharded "
                                                                  "logits yet): drop --do-sample"),
])
def test_cli_wording(tiny, capsys, argv, message):
    code, err = _err(capsys, "run", "--model", str(tiny), *argv)
    assert code == 2 and message in err and "--no-do-sample" not in err and "['']" not in err


def test_library_wording_counts_in_words(tiny):
    s = Session(core.load_model(tiny), batch=2, capacity=32)
    with pytest.raises(RequestError, match="got 1 prompt$"):
        s.check_prompts([[1, 2]], 1)
    with pytest.raises(RequestError, match="1 entry for 2 rows"):
        s.check_sampling([None])


def test_an_unsupported_architecture_is_refused_before_any_build(tmp_path, monkeypatch, capsys):
    import core.models.prepare as p

    monkeypatch.setenv("LOCKSTEP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(p, "_run_builder", lambda *a: pytest.fail("the builder ran"))
    hf = tmp_path / "bert"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"architectures": ["BertForMaskedLM"]}))
    (hf / "model.safetensors").write_bytes(b"w")
    (hf / "tokenizer.json").write_text("{}")
    code, err = _err(capsys, "run", "--model", str(hf), "--prompt", "hi")
    assert code == 2 and "is a BertForMaskedLM; Lockstep builds and runs these families: Llama, SmolLM2 " \
                         "(LlamaForCausalLM)" in err and "Qwen3 (Qwen3ForCausalLM)" in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_prepare_through_python_does_not_name_cli_flags(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(PrepareError) as exc:
        prepare(output=tmp_path / "file")
    assert "--output" not in str(exc.value) and "is a file" in str(exc.value)


def test_a_path_source_already_built_says_nothing_about_preparing(tmp_path, monkeypatch, capsys, tiny):
    """`lockstep run --model HF_DIR`: the status line appears only when something is prepared."""
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    monkeypatch.setattr("core.cli.resolve_model", lambda *a, **k: tiny)  # found in the cache, no progress
    assert main(["run", "--model", str(hf), "--raw", "--max-new-tokens", "1", "--prompt", "hi"]) == 0
    assert "preparing" not in capsys.readouterr().err

    def building(*a, progress, **k):
        progress("building")
        return tiny

    monkeypatch.setattr("core.cli.resolve_model", building)
    assert main(["run", "--model", str(hf), "--raw", "--max-new-tokens", "1", "--prompt", "hi"]) == 0
    assert "preparing" in capsys.readouterr().err
