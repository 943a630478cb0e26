"""Shared fixtures: the prepared SmolLM2 model folders (built once, cached under the user cache)."""

import pytest

PROMPTS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "Hi",
    "Explain in one sentence why the sky is blue, and mention the scientist who first described it.",
]


def _prepared(precision: str, target: str):
    from core.models.prepare import Variant, prepare

    return prepare(Variant("smollm2-135m", precision, target))


@pytest.fixture(scope="session")
def fp32_model_dir():
    return _prepared("fp32", "cpu")


@pytest.fixture(scope="session")
def int4_model_dir():
    return _prepared("int4", "cpu")


@pytest.fixture(scope="session")
def fp32_model(fp32_model_dir):
    from core.models.model import load_model

    return load_model(fp32_model_dir)


@pytest.fixture(scope="session")
def int4_model(int4_model_dir):
    from core.models.model import load_model

    return load_model(int4_model_dir)


@pytest.fixture(scope="session")
def prompt_ids(fp32_model):
    from core.generation.generate import encode_prompts

    return encode_prompts(fp32_model, PROMPTS, chat=True)
