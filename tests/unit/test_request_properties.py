"""Property test (hypothesis): >= 1,000 generated requests against one Runner (tiny model,
cpu_reference). A valid request's rows equal their solo (batch 1) runs bitwise; an invalid one
is a RequestError; whatever came before, the next request is right."""

from __future__ import annotations

import gc

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import core
from core.runtime.runner import Runner
from core.session import RequestError
from core.testing.tiny_model import TinyConfig, make_tiny_model
from providers.cpu_reference.provider import CpuReferenceProvider

#: Requests per run (hypothesis examples): about 6 s on one CPU core.
EXAMPLES = 1000
VOCAB, CONTEXT = 64, 32

tokens = st.integers(0, VOCAB - 1)
prompts = st.lists(tokens, min_size=1, max_size=6)
sampling = st.one_of(
    st.none(),
    st.fixed_dictionaries({"do_sample": st.just(True), "seed": st.integers(0, 3),
                           "temperature": st.sampled_from([0.5, 1.0]), "top_k": st.sampled_from([0, 5])}),
    st.fixed_dictionaries({"repetition_penalty": st.just(1.3)}),
)


@st.composite
def valid_requests(draw) -> dict:
    rows = draw(st.integers(1, 3))
    return dict(input_ids=draw(st.lists(prompts, min_size=rows, max_size=rows)),
                max_new_tokens=draw(st.lists(st.integers(0, 4), min_size=rows, max_size=rows)),
                sampling=draw(st.lists(sampling, min_size=rows, max_size=rows)),
                stop_token_ids=draw(st.one_of(st.none(), st.lists(tokens, max_size=2))))


#: Ways to break a valid request (each must be a RequestError before any work).
BREAKS = {
    "token id beyond the vocabulary": lambda r: {**r, "input_ids": [[VOCAB]] + r["input_ids"][1:]},
    "negative token id": lambda r: {**r, "input_ids": [[-1]] + r["input_ids"][1:]},
    "token id beyond int64": lambda r: {**r, "input_ids": [[2**63]] + r["input_ids"][1:]},
    "float token": lambda r: {**r, "input_ids": [[1.5]] + r["input_ids"][1:]},
    "empty row": lambda r: {**r, "input_ids": [[]] + r["input_ids"][1:]},
    "row past the context": lambda r: {**r, "input_ids": [[1] * (CONTEXT + 1)] + r["input_ids"][1:]},
    "negative max_new_tokens": lambda r: {**r, "max_new_tokens": -1},
    "max_new_tokens list of the wrong length": lambda r: {**r, "max_new_tokens": r["max_new_tokens"] + [1]},
    "bool max_new_tokens": lambda r: {**r, "max_new_tokens": True},
    "negative temperature": lambda r: {**r, "sampling": [{"temperature": -1.0}] * len(r["input_ids"])},
    "vanishing top_p": lambda r: {**r, "sampling": [{"do_sample": True, "top_p": 1e-300}] * len(r["input_ids"])},
    "unknown option": lambda r: {**r, "sampling": [{"beam": 2}] * len(r["input_ids"])},
    "stop id outside the vocabulary": lambda r: {**r, "stop_token_ids": [VOCAB]},
    "float stop id": lambda r: {**r, "stop_token_ids": 1.5},
    "truthy capture string": lambda r: {**r, "capture": "yes"},
    "progress not callable": lambda r: {**r, "progress": 3},
    "input_ids not a list": lambda r: {**r, "input_ids": None},
}


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    cfg = TinyConfig(hidden=32, heads=2, kv_heads=1, head_size=16, intermediate=64, vocab=VOCAB, context=CONTEXT,
                     layers=1)
    return Runner(make_tiny_model(tmp_path_factory.mktemp("props"), config=cfg), CpuReferenceProvider())


def test_generated_requests_are_right_or_refused_and_never_harm_the_next(runner):
    solo: dict = {}
    seen = {"valid": 0, "invalid": 0}

    def alone(prompt, new, options, stop) -> list[int]:
        key = (tuple(prompt), new, repr(options), repr(stop))
        if key not in solo:
            solo[key] = core.run(runner, input_ids=[prompt], max_new_tokens=new, sampling=[options],
                                 stop_token_ids=stop).rows[0].output_ids
        return solo[key]

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(request=valid_requests(), broken=st.one_of(st.none(), st.sampled_from(sorted(BREAKS))))
    def check(request, broken):
        if broken is not None:
            seen["invalid"] += 1
            with pytest.raises(RequestError):
                core.run(runner, **BREAKS[broken](request))
            return
        seen["valid"] += 1
        rows = core.run(runner, **request).rows
        for b, row in enumerate(rows):
            want = alone(request["input_ids"][b], request["max_new_tokens"][b], request["sampling"][b],
                         request["stop_token_ids"])
            assert row.output_ids == want, (b, request)
            assert all(0 <= t < VOCAB for t in row.output_ids)

    check()
    assert seen["valid"] + seen["invalid"] >= EXAMPLES
    assert seen["valid"] >= EXAMPLES // 4 and seen["invalid"] >= EXAMPLES // 4
    gc.collect()  # every request's session is gone: the runner accounts exactly its pooled states' KV
    assert runner.kv_device_bytes == sum(state.kv.device_bytes for state in runner._free)
