"""The OpenAI request parser of `lockstep serve` (core.serve.openai_api) on malformed bodies: each
is an APIError 400 naming the field, never another exception (which the server answers 500)."""

from __future__ import annotations

import pytest

from core.serve import openai_api as api

MODEL = "m"


def parse(body: dict, chat: bool = False) -> api.Parsed:
    return api.parse({"model": MODEL, **body}, api.CHAT_FIELDS if chat else api.COMPLETION_FIELDS, MODEL, chat)


@pytest.mark.parametrize("messages", [["Hi"], [None], [{"role": "user", "content": "Hi"}, 5]])
def test_a_message_that_is_not_an_object_is_a_400(messages):
    with pytest.raises(api.APIError, match=r"messages\[\d\] must be an object") as info:
        parse({"messages": messages}, chat=True)
    assert info.value.status == 400 and info.value.param == "messages"


@pytest.mark.parametrize("name", ["presence_penalty", "frequency_penalty"])
@pytest.mark.parametrize("value", [0.5, -1, "x", True])
def test_a_non_zero_penalty_is_refused_as_not_supported(name, value):
    with pytest.raises(api.APIError, match=rf"{name} is not supported \(0 only\)") as info:
        parse({"prompt": "x", name: value})
    assert info.value.param == name


@pytest.mark.parametrize("value", [0, 0.0, None])
def test_a_zero_penalty_is_accepted(value):
    assert parse({"prompt": "x", "presence_penalty": value, "frequency_penalty": value}).prompt == "x"


@pytest.mark.parametrize("value", ["yes", 1, {}])
def test_include_usage_must_be_a_bool(value):
    with pytest.raises(api.APIError, match="include_usage must be true or false") as info:
        parse({"prompt": "x", "stream": True, "stream_options": {"include_usage": value}})
    assert info.value.param == "stream_options"


def test_include_usage_true_false_or_null():
    for value, want in ((True, True), (False, False), (None, False)):
        assert parse({"prompt": "x", "stream": True, "stream_options": {"include_usage": value}}).include_usage is want
