"""core/models/builder_compat.py: the config fields the 0.18 builder reads, derived from
transformers 5's nested rope_parameters (no builder run: the models tier builds Gemma 3)."""

import json

import pytest

from core.models.builder_compat import compat_config

transformers = pytest.importorskip("transformers")


def _loaded(tmp_path, **fields):
    (tmp_path / "config.json").write_text(json.dumps(fields))
    return transformers.AutoConfig.from_pretrained(str(tmp_path))


GEMMA3 = dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", hidden_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256, sliding_window=24,
              rope_theta=1000000.0, rope_local_base_freq=10000.0, rope_scaling={"rope_type": "linear", "factor": 8.0})


def test_gemma3_checkpoint_gets_the_fields_the_builder_reads(tmp_path):
    config = _loaded(tmp_path, **GEMMA3)
    with pytest.raises(AttributeError):  # what stopped the 0.18 builder
        _ = config.rope_local_base_freq
    changed = compat_config(config)
    assert config.rope_local_base_freq == 10000.0
    rope = config.rope_parameters
    assert (rope["rope_type"], rope["rope_theta"], rope["factor"]) == ("linear", 1000000.0, 8.0)  # the global layers'
    assert rope["sliding_attention"] == {"rope_type": "default", "rope_theta": 10000.0}  # nested values kept
    assert set(changed) == {"rope_local_base_freq", "rope_parameters.rope_type", "rope_parameters.rope_theta",
                            "rope_parameters.factor"}
    assert compat_config(config) == []  # idempotent


def test_flat_configs_and_present_fields_are_left_alone(tmp_path):
    llama = _loaded(tmp_path, architectures=["LlamaForCausalLM"], model_type="llama", rope_theta=500000.0)
    before = dict(llama.rope_parameters)
    assert compat_config(llama) == [] and llama.rope_parameters == before
    (tmp_path / "g").mkdir()
    gemma = _loaded(tmp_path / "g", **GEMMA3)
    gemma.rope_local_base_freq = 123.0
    gemma.rope_parameters["rope_theta"] = 7.0
    compat_config(gemma)
    assert gemma.rope_local_base_freq == 123.0 and gemma.rope_parameters["rope_theta"] == 7.0
