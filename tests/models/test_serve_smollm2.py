"""The engine and `lockstep serve` on SmolLM2-135M fp32 (cpu_reference): random arrivals equal
their solo runs, and the openai client's chat answers equal the solo run through the real chat
template and tokenizer."""

from __future__ import annotations

import concurrent.futures
from pathlib import Path

import pytest

from core.runtime.runner import Runner
from core.testing.arrivals import expected_events, fuzz_arrivals, solo_tokens


def test_engine_arrivals_equal_solo_runs(fp32_model_dir):
    report = fuzz_arrivals(Runner(fp32_model_dir, "cpu_reference"), seed=135, requests=10, max_batch=4,
                           capacity=48, longest=10, arrival_span=12)
    assert report.mismatches == []
    assert report.max_running >= 2


def test_openai_chat_on_smollm2_equals_solo(fp32_model_dir):
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")

    from core.engine import Engine
    from core.generation.generate import encode_messages
    from core.session import Session
    from core.testing.serving import start_server, stop_server

    proc, url = start_server(Path(fp32_model_dir), "--max-batch", "4", "--capacity", "256", "--model-name", "smol",
                             cwd=Path(__file__).resolve().parents[2])
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
        questions = ["What is 2 + 2?", "Name a colour.", "Say hello in French.", "What is the capital of Italy?"]

        def ask(q):
            chunks = list(client.chat.completions.create(
                model="smol", messages=[{"role": "user", "content": q}], max_tokens=12, stream=True,
                stream_options={"include_usage": True}))
            return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks[-1].usage

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            got = list(pool.map(ask, questions))
    finally:
        stop_server(proc)
    runner = Runner(fp32_model_dir, "cpu_reference")
    engine = Engine(runner, max_batch=1, capacity=256)
    session = Session(runner, batch=1, capacity=256, kv_policy="fixed")
    for q, (text, usage) in zip(questions, got):
        ids = encode_messages(runner.model, [[{"role": "user", "content": q}]])[0]
        req = engine.request(ids, 12)
        events = expected_events(engine, req, solo_tokens(session, req))
        assert text == "".join(e.text for e in events) and text
        assert (usage.prompt_tokens, usage.completion_tokens) == (len(ids), sum(len(e.token_ids) for e in events))


@pytest.mark.parametrize("text", ["東京は日本の首都です。", "Party time 🎉🥳 with family 👨‍👩‍👧‍👦 and flags 🇫🇷!",
                                  "混合 text: 한국어, Ελληνικά, emoji 👍🏽 and ∑ math", "  spaced\n\tout  "])
def test_window_detokenizer_on_smollm2(fp32_model, text):
    from core.engine.detok import WindowDetokenizer

    tok = fp32_model.tokenizer
    ids = tok.encode(text)
    d = WindowDetokenizer(tok, holdback=2)
    parts = []
    for t in ids:
        d.add(t)
        parts.append(d.release())
    parts.append(d.finish())
    assert "".join(parts) == tok.decode(ids) == text
    assert not any("\ufffd" in p for p in parts)
