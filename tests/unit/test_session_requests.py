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
    s = Session(model_dir)
    cfg = s.model.config
    table = cfg.vocab_size * cfg.hidden_size * s.model.io_dtype.itemsize
    assert s.plan.weight_bytes() - s.plan.step_weight_bytes() >= table
    assert np.isclose(s.plan.step_weight_bytes(), s.model.weight_bytes(), rtol=0.01)


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
    ("names", "past_key_names")])
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
