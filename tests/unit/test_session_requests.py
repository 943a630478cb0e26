"""Session-level request checks on the tiny model (fast; the SmolLM2 ones are in tests/models)."""

import numpy as np
import pytest

import core
from core.session import RequestError, Session
from core.testing.tiny_model import make_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


def test_default_capacity_fits_a_short_context(model_dir):
    s = Session(model_dir)  # the tiny model's context is 128 < the default 256
    assert s.capacity <= s.model.config.context_length
    assert Session(model_dir, max_capacity=32).capacity == 32


@pytest.mark.parametrize("forced", [[-1, 5], [10**6, 5], [1.5, 2.0], [1]])
def test_bad_forced_tokens_are_refused_and_leave_the_session_consistent(model_dir, forced):
    s = Session(model_dir, batch=2, capacity=32)
    s.prefill([[5, 6, 7], [8, 9]])
    with pytest.raises(RequestError, match="force_tokens"):
        s.step(force_tokens=forced)
    assert s.lengths.tolist() == [3, 2] and s.state.lengths_dev.tolist() == [3, 2]
    assert s.state.attention_mask.sum(axis=1).tolist() == [3, 2]
    s.step(force_tokens=[1, 2])
    assert s.lengths.tolist() == [4, 3]


def test_seq_major_growth_at_batch_above_one_is_a_request_error(model_dir):
    with pytest.raises(RequestError, match="relocate"):
        Session(model_dir, batch=2, kv_layout="seq_major", kv_policy="growing")


def test_committed_bytes_never_exceed_the_cache_across_growth(model_dir):
    s = Session(model_dir, batch=2, capacity=8, kv_policy="growing")
    s.prefill([[5, 6, 7], [8, 9]])
    for _ in range(60):
        s.step()
    assert s.counters.growth_events >= 2
    assert 0 < s.counters.kv_committed_bytes <= s.counters.kv_bytes


def test_batch_must_be_a_true_integer(model_dir):
    with pytest.raises(RequestError):
        Session(model_dir, batch=True)


def test_the_floor_counts_weights_a_step_reads_not_gather_tables(model_dir):
    from core.fusion import FUSED_DOMAIN
    from providers.cpu_reference.provider import CpuReferenceProvider

    class Unfused(CpuReferenceProvider):
        def supports(self, node):
            return node.domain != FUSED_DOMAIN and super().supports(node)

    s = Session(model_dir)
    cfg = s.model.config
    table = cfg.vocab_size * cfg.hidden_size * s.model.io_dtype.itemsize
    # the tied lookup reads the lm_head's weight (GatherColumns): the table is read in full by
    # the lm_head every step, once, and no transposed copy of it is resident
    assert 0 <= s.plan.weight_bytes() - s.plan.step_weight_bytes() < table
    assert np.isclose(s.plan.step_weight_bytes(), s.model.weight_bytes(), rtol=0.01)
    # unfused, the folded Transpose is a gather table of its own: resident, not in the floor
    u = Session(model_dir, Unfused())
    assert u.plan.weight_bytes() - u.plan.step_weight_bytes() >= table
    assert u.plan.step_weight_bytes() == s.plan.step_weight_bytes()


def test_a_provider_that_does_not_write_the_shared_kv_in_place_is_refused(model_dir):
    from core.plugins import ProviderError
    from providers.cpu_reference.provider import CpuReferenceProvider

    class CopyingKV(CpuReferenceProvider):
        def kernel(self, node):
            run = super().kernel(node)
            if node.op_type != "GroupQueryAttention":
                return run
            return lambda ctx, *args: tuple(o.copy() if o is not None else o for o in run(ctx, *args))

    s = Session(model_dir, CopyingKV(), batch=1, capacity=16)
    with pytest.raises(ProviderError, match="in place"):
        s.prefill([[5, 6]])


def _tiny_with_tokenizer(folder):
    """The tiny model plus a two-word tokenizer.json."""
    from tokenizers import Tokenizer, models

    folder = make_tiny_model(folder)
    Tokenizer(models.WordLevel({"<unk>": 0, "hi": 1}, unk_token="<unk>")).save(str(folder / "tokenizer.json"))
    return folder


@pytest.mark.parametrize("case,match", [
    ("tokenizer", "tokenizer.json"), ("config", "tokenizer_config.json"),
    ("template", "chat_template.jinja"), ("template_in_config", "does not parse"),
    ("names", "past_key_names"), ("empty_genai_config", "genai_config.json is malformed: it has no 'model' entry"),
    ("no_decoder_sizes", "it has no 'num_hidden_layers' entry")])
def test_malformed_model_files_are_model_errors_naming_the_file(tmp_path, case, match):
    import json

    folder = _tiny_with_tokenizer(tmp_path / case)
    if case == "tokenizer":
        (folder / "tokenizer.json").write_text("not json")
    elif case == "config":
        (folder / "tokenizer_config.json").write_text("{broken")
    elif case == "template":
        (folder / "chat_template.jinja").write_text("{% if %}")
    elif case == "template_in_config":
        (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ x "}))
    elif case == "empty_genai_config":
        (folder / "genai_config.json").write_text("{}")
    elif case == "no_decoder_sizes":
        cfg = json.loads((folder / "genai_config.json").read_text())
        del cfg["model"]["decoder"]["num_hidden_layers"]
        (folder / "genai_config.json").write_text(json.dumps(cfg))
    else:
        cfg = json.loads((folder / "genai_config.json").read_text())
        cfg["model"]["decoder"].setdefault("inputs", {})["past_key_names"] = "past_key_values.key"
        (folder / "genai_config.json").write_text(json.dumps(cfg))
    with pytest.raises(core.ModelError, match=match):
        core.load_model(folder)


@pytest.mark.parametrize("rows", [[[1.7, 2.0]], [["a", "b"]], [1, 2, 3], [[[1]]]])
def test_run_refuses_input_ids_that_are_not_integer_rows(model_dir, rows):
    with pytest.raises(RequestError, match="integer token ids"):
        core.run(model_dir, input_ids=rows, max_new_tokens=2)
    assert core.run(model_dir, input_ids=[[1, 2]], max_new_tokens=2).rows[0].output_ids


@pytest.mark.parametrize("value", [0, -5, 2.5, True])
def test_max_capacity_must_be_a_positive_integer(model_dir, value):
    with pytest.raises(RequestError, match="max_capacity"):
        Session(model_dir, batch=1, kv_policy="growing", max_capacity=value)


@pytest.mark.parametrize("prompt, message", [("\udcff x", "not valid UTF-8"), (b"Hi", "must be a str"),
                                             (None, "must be a str")])
def test_prompts_that_are_not_text_are_refused_in_one_line(prompt, message):
    from core.generation.generate import encode_prompts
    from core.models.model import Model

    class Tok:
        def apply_chat_template(self, text):
            return text

        def encode(self, text):
            return [1]

    model = Model.__new__(Model)
    model.tokenizer, model.folder = Tok(), "m"
    with pytest.raises(RequestError, match=message):
        encode_prompts(model, [prompt], chat=False)


def test_a_runner_refuses_another_provider_in_core_run(model_dir):
    import core
    from core.runtime.runner import Runner

    runner = Runner(model_dir, "cpu_reference")
    with pytest.raises(RequestError, match="runs on provider 'cpu_reference'"):
        core.run(runner, provider="numpy64", input_ids=[[1, 2]], max_new_tokens=1)
    assert core.run(runner, provider="cpu_reference", input_ids=[[1, 2]], max_new_tokens=1).rows


@pytest.mark.parametrize("ids, message", [
    (None, "input_ids must be a list"), ([None], "got None"), ([[[1, 2]]], "token 0 is a nested list"),
    ([[1.0, 2.0]], "token 0 is float"), ([[True, False]], "token 0 is bool"), ([[1, None]], "token 1 is None"),
    ([["a"]], "token 0 is str"), ([1], "got 1"), (["ab"], "got 'ab'"), ([[]], "is empty"),
    ([[1, 999]], r"outside \[0, 256\): 1..999")])
def test_prefill_says_what_is_wrong_with_the_ids_and_stays_usable(model_dir, ids, message):
    s = Session(model_dir, batch=1, capacity=16)
    with pytest.raises(RequestError, match=message):
        s.prefill(ids)
    assert not s.started and s.prefill([[1, 2]]).tokens.shape == (1,)


def test_numpy_token_rows_are_accepted(model_dir):
    s = Session(model_dir, batch=2, capacity=16)
    a = s.prefill([np.array([1, 2, 3], np.int32), np.array([4], np.uint16)]).tokens
    b = Session(model_dir, batch=2, capacity=16).prefill([[1, 2, 3], [4]]).tokens
    assert np.array_equal(a, b)


@pytest.mark.parametrize("prompts, message", [
    ([123], "prompt 0 must be a str, got int; token ids go in input_ids="), (123, "prompts must be a list"),
    (["ok", "\udcff"], "prompt 1 is not valid UTF-8"), (["  "], "prompt 0 is empty")])
def test_run_checks_prompt_texts_before_loading_the_model(tmp_path, prompts, message):
    # the folder does not exist: a prompt error must come first, before any model work
    with pytest.raises(RequestError, match=message):
        core.run(tmp_path / "absent", prompts=prompts)


def _decoder_config(folder):
    import json

    return json.loads((folder / "genai_config.json").read_text())


def _graph_variant(tmp_path, name, edit):
    """The tiny model with its graph edited by ``edit(model_proto)`` (weights inlined)."""
    import onnx

    folder = make_tiny_model(tmp_path / name)
    proto = onnx.load(str(folder / "model.onnx"))
    edit(proto)
    onnx.save(proto, str(folder / "model.onnx"))
    return folder


def test_a_zero_byte_model_file_is_a_model_error(tmp_path):
    folder = make_tiny_model(tmp_path / "m")
    (folder / "model.onnx").write_bytes(b"")
    with pytest.raises(core.ModelError, match="is empty"):
        core.run(folder, input_ids=[[1, 2]], max_new_tokens=2)


def test_a_graph_that_is_not_a_decoder_is_refused_at_load(tmp_path):
    import onnx
    from onnx import TensorProto, helper

    folder = make_tiny_model(tmp_path / "m")
    x = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1]) for n in ("a", "b", "logits")]
    graph = helper.make_graph([helper.make_node("Add", ["a", "b"], ["logits"])], "g", x[:2], x[2:])
    onnx.save(helper.make_model(graph), str(folder / "model.onnx"))
    with pytest.raises(core.ModelError, match="graph inputs missing: input_ids, attention_mask"):
        core.load_model(folder)


def _set_dims(vi, dims):
    del vi.type.tensor_type.shape.dim[:]
    for d in dims:
        dim = vi.type.tensor_type.shape.dim.add()
        if isinstance(d, int):
            dim.dim_value = d
        else:
            dim.dim_param = d


def _output(proto, name):
    return next(vi for vi in proto.graph.output if vi.name == name)


def _input(proto, name):
    return next(vi for vi in proto.graph.input if vi.name == name)


@pytest.mark.parametrize("case, edit, message", [
    ("no_vocab_axis", lambda p: _set_dims(_output(p, "logits"), ["batch_size", "sequence_length"]),
     r"logits has shape \['batch_size', 'sequence_length'\], expected rank 3"),
    ("wrong_vocab", lambda p: _set_dims(_output(p, "logits"), ["b", "s", 255]), "vocab axis of logits is 255"),
    ("symbolic_vocab", lambda p: _set_dims(_output(p, "logits"), ["b", "s", "v"]), "vocab axis of logits is 'v'"),
    ("int32_ids", lambda p: setattr(_input(p, "input_ids").type.tensor_type, "elem_type", 6),
     "input_ids is INT32, expected int64"),
    ("kv_heads", lambda p: _set_dims(_input(p, "past_key_values.1.value"), ["b", 3, "s", 16]),
     "past_key_values.1.value has shape .* axis 1 = 2"),
    ("extra_input", lambda p: p.graph.input.append(
        __import__("onnx").helper.make_tensor_value_info("position_ids", 7, ["b", "s"])),
     "does not feed: position_ids"),
    ("no_present", lambda p: p.graph.output.remove(_output(p, "present.1.key")), "outputs missing: present.1.key"),
])
def test_graph_inputs_and_outputs_are_checked_against_genai_config(tmp_path, case, edit, message):
    folder = _graph_variant(tmp_path, case, edit)
    with pytest.raises(core.ModelError, match=message):
        core.load_model(folder)


def test_genai_config_naming_other_bound_tensors_is_refused(tmp_path):
    import json

    folder = make_tiny_model(tmp_path / "m")
    cfg = _decoder_config(folder)
    cfg["model"]["decoder"]["outputs"]["logits"] = "scores"
    (folder / "genai_config.json").write_text(json.dumps(cfg))
    with pytest.raises(core.ModelError, match="names the logits tensor 'scores'"):
        core.load_model(folder)


def test_last_logits_of_a_session_another_one_overwrote_is_a_clear_error(model_dir):
    """Two sessions on one Runner share the plan's output buffers: after the second one steps,
    the first one's last_logits() would read the second one's logits. It raises instead, and
    the first session still serves its next step (whose logits it then reads)."""
    runner = core.Runner(model_dir)
    a, b = Session(runner, batch=1, capacity=32), Session(runner, batch=1, capacity=32)
    with pytest.raises(RequestError, match="call prefill"):
        a.last_logits()
    a.prefill([[5, 6, 7]])
    mine = a.last_logits()
    b.prefill([[9, 10, 11, 12]])
    with pytest.raises(RequestError, match="another Session on the same Runner"):
        a.last_logits()
    assert not np.array_equal(b.last_logits(), mine)  # what a would have read
    a.step()
    assert a.last_logits().shape == mine.shape  # a's own step again
    alone = Session(core.Runner(model_dir), batch=1, capacity=32)
    alone.prefill([[5, 6, 7]])
    alone.step()
    assert np.array_equal(a.last_logits(), alone.last_logits())
