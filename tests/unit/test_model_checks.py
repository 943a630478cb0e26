"""Broken model folders are one ModelError at load, naming the file and the field (issue 39);
a list-form chat template (as Hugging Face writes it) loads; template errors at render time
are ModelErrors. Tiny model, no device work beyond one request."""

from __future__ import annotations

import json
import shutil

import onnx
import pytest

import core
from core.models.model import ModelError, load_model
from core.testing.tiny_model import BYTE_CHAT_TEMPLATE, make_tiny_model, write_byte_tokenizer


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return write_byte_tokenizer(make_tiny_model(tmp_path_factory.mktemp("good")))


@pytest.fixture
def folder(good, tmp_path):
    return shutil.copytree(good, tmp_path / "model")


def edit_config(folder, change) -> None:
    path = folder / "genai_config.json"
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def edit_tokenizer_config(folder, **fields) -> None:
    path = folder / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


CONFIG_BREAKS = {
    "model.eos_token_id": lambda d: d["model"].update(eos_token_id=[]),
    "model.pad_token_id": lambda d: d["model"].update(pad_token_id=d["model"]["vocab_size"] + 5),
    "model.decoder must": lambda d: d["model"].update(decoder="model.onnx"),
    "model.decoder.filename": lambda d: d["model"]["decoder"].update(filename=5),
    "model.decoder.inputs": lambda d: d["model"]["decoder"].update(inputs=["input_ids"]),
    "model.decoder.outputs.logits": lambda d: d["model"]["decoder"]["outputs"].update(logits=3),
    "model.vocab_size": lambda d: d["model"].update(vocab_size="256"),
    "search: sampling option top_k": lambda d: d["search"].update(top_k=1.5),
    "model.context_length": lambda d: d["model"].update(context_length=4096),
}


@pytest.mark.parametrize("field", sorted(CONFIG_BREAKS))
def test_a_bad_genai_config_field_is_a_model_error_naming_file_and_field(folder, field):
    edit_config(folder, CONFIG_BREAKS[field])
    with pytest.raises(ModelError, match="genai_config.json") as info:
        load_model(folder)
    assert field in str(info.value)


def test_a_missing_initializer_is_caught_at_load(folder):
    proto = onnx.load(str(folder / "model.onnx"))
    lost = proto.graph.initializer[3].name
    del proto.graph.initializer[3]
    onnx.save(proto, str(folder / "model.onnx"))
    with pytest.raises(ModelError, match="model.onnx") as info:
        load_model(folder)
    assert lost in str(info.value)


@pytest.mark.parametrize("field,value", [("eos_token", 5), ("bos_token", ["<s>"]),
                                         ("chat_template", [{"name": "tool_use", "template": "x"}]),
                                         ("chat_template", 7)])
def test_a_bad_tokenizer_config_field_is_a_model_error(folder, field, value):
    edit_tokenizer_config(folder, **{field: value})
    with pytest.raises(ModelError, match="tokenizer_config.json") as info:
        load_model(folder)
    assert field in str(info.value)


def test_a_tokenizer_config_that_is_a_folder_is_a_model_error(folder):
    (folder / "tokenizer_config.json").unlink()
    (folder / "tokenizer_config.json").mkdir()
    with pytest.raises(ModelError, match="tokenizer_config.json"):
        load_model(folder)


def test_a_list_form_chat_template_uses_its_default_entry(folder, good):
    edit_tokenizer_config(folder, chat_template=[{"name": "tool_use", "template": "{{ 1 / 0 }}"},
                                                 {"name": "default", "template": BYTE_CHAT_TEMPLATE}])
    model = load_model(folder)
    assert model.tokenizer.chat_template == BYTE_CHAT_TEMPLATE
    want = core.run(good, prompts=["hi"], max_new_tokens=4)
    got = core.run(model, prompts=["hi"], max_new_tokens=4)
    assert got.rows[0].prompt_ids == want.rows[0].prompt_ids and got.rows[0].output_ids == want.rows[0].output_ids
    assert core.run(model, input_ids=[[5, 6]], max_new_tokens=2).rows[0].output_ids


@pytest.mark.parametrize("template", ["{{ messages[0].content.nope() }}", "{{ messages[0]['content'] + 1 }}",
                                      "{{ messages[7].content }}"])
def test_a_template_failing_at_render_is_a_model_error(folder, template):
    edit_tokenizer_config(folder, chat_template=template)
    model = load_model(folder)
    with pytest.raises(ModelError, match="chat template"):
        core.run(model, prompts=["hi"], max_new_tokens=2)
    assert core.run(model, prompts=["hi"], chat=False, max_new_tokens=2).rows[0].output_ids


def test_a_genai_config_top_k_beyond_int32_runs_as_every_token(folder):
    edit_config(folder, lambda d: d["search"].update(do_sample=True, top_k=2**32, random_seed=4))
    model = load_model(folder)
    got = core.run(model, input_ids=[[5, 6, 7]], max_new_tokens=6).rows[0]
    assert got.sampling["top_k"] == 2**32
    want = core.run(model, input_ids=[[5, 6, 7]], max_new_tokens=6, top_k=0).rows[0]
    assert got.output_ids == want.output_ids
