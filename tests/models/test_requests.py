"""Bad input: a clear error before any work, and the same session then serves a good request
(docs/cases.md 15)."""

import json
import shutil
import subprocess
import sys

import onnx
import pytest

import core
from core.generation.generate import generate
from core.session import Session

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def session(fp32_model):
    return Session(fp32_model, "cpu_reference", batch=1, capacity=64)


def good_request_works(session, fp32_model):
    ids = fp32_model.tokenizer.encode("The capital of France is")
    (tokens, reason), = generate(session, [ids], 3)
    assert len(tokens) == 3 and reason == "length"


@pytest.mark.parametrize("bad, match", [
    ([[]], "empty"),
    ([[1] * 65], "capacity is 64"),
    ([[1, 2], [3]], "batch 1"),
    ([[10**6]], "token ids outside"),
    ([[-1]], "token ids outside"),
])
def test_bad_prompt_is_refused_then_session_serves(session, fp32_model, bad, match):
    with pytest.raises(core.RequestError, match=match):
        generate(session, bad, 4)
    good_request_works(session, fp32_model)


@pytest.mark.parametrize("length, new, ok", [
    (63, 0, True), (63, 1, True), (63, 2, True), (63, 5, False),
    (64, 0, True), (64, 1, True), (64, 2, False), (65, 0, False), (65, 1, False),
])
def test_prompt_at_capacity_edge(session, fp32_model, length, new, ok):
    """docs/cases.md 15: C-1, C, C+1 tokens with max_new_tokens 0, 1, 2, 5 against capacity C = 64:
    a request needs prompt + max_new_tokens - 1 positions (the last token is never fed back)."""
    ids = [[5] * length]
    if ok:
        out = generate(session, ids, new)
        assert len(out[0][0]) == new
    else:
        with pytest.raises(core.RequestError, match="capacity"):
            generate(session, ids, new)
    good_request_works(session, fp32_model)


def test_negative_max_new_tokens_is_refused(session, fp32_model):
    with pytest.raises(core.RequestError, match="non-negative"):
        generate(session, [[1, 2]], -1)
    with pytest.raises(core.RequestError, match="non-negative"):
        core.run(fp32_model, input_ids=[[1, 2]], max_new_tokens=-1)
    good_request_works(session, fp32_model)


def test_empty_prompt_text_is_refused(fp32_model):
    with pytest.raises(core.RequestError, match="prompt 1 is empty"):
        core.run(fp32_model, prompts=["hello", "  "], max_new_tokens=2)


def test_unknown_provider_lists_the_installed_ones(fp32_model):
    with pytest.raises(core.ProviderError, match="installed: .*cpu_reference"):
        core.run(fp32_model, provider="nope", input_ids=[[1]], max_new_tokens=1)


def test_missing_model_folder_and_files(tmp_path, fp32_model_dir):
    with pytest.raises(core.ModelError, match="not found"):
        core.load_model(tmp_path / "absent")
    with pytest.raises(core.ModelError, match="genai_config.json"):
        core.load_model(tmp_path)
    broken = tmp_path / "broken"
    broken.mkdir()
    shutil.copy(fp32_model_dir / "genai_config.json", broken)
    with pytest.raises(core.ModelError, match="model.onnx"):
        core.load_model(broken)


def test_unsupported_op_is_reported_at_load_naming_op_and_node(tmp_path, fp32_model_dir):
    folder = tmp_path / "odd"
    folder.mkdir()
    for name in ("genai_config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(fp32_model_dir / name, folder)
    proto = onnx.load(str(fp32_model_dir / "model.onnx"), load_external_data=False)
    node = next(n for n in proto.graph.node if n.op_type == "Sigmoid")
    node.op_type = "HardSwish"
    onnx.save(proto, str(folder / "model.onnx"))
    shutil.copy(fp32_model_dir / "model.onnx.data", folder)
    with pytest.raises(core.UnsupportedOpError, match=f"HardSwish at node '{node.name}'"):
        Session(folder, "cpu_reference", batch=1, capacity=16)


def test_cli_run_json_and_error_exit(fp32_model_dir):
    cmd = [sys.executable, "-m", "core", "run", "--model", str(fp32_model_dir), "--prompt",
           "What is the capital of France?", "--prompt", "Hi", "--max-new-tokens", "8", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    data = json.loads(out.stdout)
    assert data["provider"] == "cpu_reference" and len(data["rows"]) == 2
    assert "Paris" in data["rows"][0]["text"]
    assert {"prompt_ids", "output_ids", "text", "finish_reason"} <= set(data["rows"][0])
    assert data["counters"]["decode_steps"] >= 1
    bad = subprocess.run(cmd[:4] + ["--prompt", "", "--provider", "cpu_reference"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "the prompt is empty" in bad.stderr
