"""`lockstep serve` against the official openai client, the server started as a subprocess on
loopback (a tiny model with a byte tokenizer and a chat template): each answer equals its solo
run, the errors are OpenAI-style bodies and the server keeps serving."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import re
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

from core.engine import Engine  # noqa: E402
from core.runtime.runner import Runner  # noqa: E402
from core.serve import openai_api as api  # noqa: E402
from core.session import Session  # noqa: E402
from core.testing.arrivals import expected_events, solo_tokens  # noqa: E402
from core.testing.serving import free_port, start_server, stop_server  # noqa: E402
from core.testing.tiny_model import TinyConfig, make_tiny_model, write_byte_tokenizer  # noqa: E402

CAPACITY = 2048
ROOT = Path(__file__).resolve().parents[2]


def post(url: str, path: str, data: bytes) -> tuple[int, dict, dict]:
    req = urllib.request.Request(url + path, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), json.loads(exc.read())


def metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_byte_tokenizer(make_tiny_model(tmp_path_factory.mktemp("serve"), config=TinyConfig(context=CAPACITY)))


@pytest.fixture(scope="module")
def server(folder):
    proc, url = start_server(folder, "--max-batch", "8", "--capacity", str(CAPACITY), "--max-waiting", "64", cwd=ROOT)
    yield url
    stop_server(proc)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def solo(folder):
    """expected(body, chat) -> (text, finish_reason, completion_tokens) of the request run alone."""
    runner = Runner(folder, "cpu_reference")
    engine = Engine(runner, max_batch=1, capacity=CAPACITY)
    session = Session(runner, batch=1, capacity=CAPACITY, kv_policy="fixed")
    lock = threading.Lock()

    def expected(body: dict, chat: bool) -> tuple[str, str, int]:
        parsed = api.parse(dict(body, model=folder.name), api.CHAT_FIELDS if chat else api.COMPLETION_FIELDS,
                           folder.name, chat)
        tok = runner.model.tokenizer
        ids = tok.encode(tok.render_chat(parsed.prompt)) if chat else tok.encode(parsed.prompt)
        max_tokens = parsed.max_tokens or (CAPACITY - len(ids) + 1 if chat else 16)
        with lock:
            req = engine.request(ids, max_tokens, parsed.sampling, parsed.stop)
            events = expected_events(engine, req, solo_tokens(session, req))
        return "".join(e.text for e in events), events[-1].finish_reason, sum(len(e.token_ids) for e in events)
    return expected


def test_models_and_health(folder, server, client):
    assert [m.id for m in client.models.list().data] == [folder.name]
    with urllib.request.urlopen(server + "/health") as r:
        assert r.status == 200


def get(url: str, path: str) -> tuple[int, dict, dict]:
    try:
        with urllib.request.urlopen(url + path, timeout=30) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), json.loads(exc.read())


def test_a_model_by_id_and_unknown_routes_have_openai_bodies(folder, server, client):
    assert client.models.retrieve(folder.name).id == folder.name
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("nope")
    for status, path in ((404, "/v1/embeddings"), (405, "/v1/completions")):
        got, _, answer = get(server, path)
        assert got == status and "no route GET " + path in answer["error"]["message"], answer
        assert answer["error"]["type"] == "invalid_request_error"
    status, _, answer = post(server, "/v1/chat/completions",
                             json.dumps({"model": folder.name, "messages": ["Hi"]}).encode())
    assert status == 400 and "messages[0] must be an object" in answer["error"]["message"]


def test_an_unexpected_failure_is_a_500_with_an_openai_body():
    import asyncio

    from starlette.requests import Request

    from core.serve.app import Server, make_app

    app = make_app(Server(lambda: None, "m"))  # the handler alone: no server, no model
    request = Request({"type": "http", "method": "POST", "path": "/v1/completions", "headers": [],
                       "query_string": b""})
    answer = asyncio.run(app.exception_handlers[Exception](request, AttributeError("boom")))
    assert answer.status_code == 500
    assert json.loads(answer.body)["error"] == {"message": "internal error: AttributeError: boom",
                                                "type": "server_error", "param": None, "code": None}


def test_completion_streamed_and_not_equal_solo(folder, client, solo):
    body = {"prompt": "The quick brown fox", "max_tokens": 24, "stop": ["zz"]}
    want = solo(body, chat=False)
    whole = client.completions.create(model=folder.name, **body)
    assert (whole.choices[0].text, whole.choices[0].finish_reason, whole.usage.completion_tokens) == want
    assert whole.usage.prompt_tokens == len(b"The quick brown fox")
    chunks = list(client.completions.create(model=folder.name, stream=True, stream_options={"include_usage": True},
                                            **body))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want[0]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == want[1]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == want[2]


def test_chat_streamed_and_not_equal_solo(folder, client, solo):
    body = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}],
            "max_tokens": 20, "temperature": 0.9, "seed": 1234}
    want = solo(body, chat=True)
    whole = client.chat.completions.create(model=folder.name, **body)
    msg = whole.choices[0].message
    assert (msg.role, msg.content, whole.choices[0].finish_reason, whole.usage.completion_tokens) == ("assistant",
                                                                                                      *want)
    chunks = list(client.chat.completions.create(model=folder.name, stream=True,
                                                 stream_options={"include_usage": True}, **body))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want[0]
    assert chunks[-1].usage.completion_tokens == want[2]
    parts = dict(body, messages=[{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                                 {"role": "user", "content": [{"type": "text", "text": "Hi "},
                                                              {"type": "text", "text": "there"}]}])
    msg = client.chat.completions.create(model=folder.name, **parts).choices[0].message
    assert msg.content == want[0]  # text parts are the string they join to
    with pytest.raises(openai.BadRequestError, match="text parts"):
        client.chat.completions.create(model=folder.name, max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}])


def test_32_concurrent_streams_each_equal_its_solo_run(folder, client, solo):
    rng = np.random.default_rng(40)
    bodies = []
    for i in range(32):
        body: dict = {"prompt": "".join(chr(c) for c in rng.integers(97, 123, int(rng.integers(1, 30)))),
                      "max_tokens": int(rng.integers(1, 50))}
        if i % 2:
            body.update(temperature=0.8, top_p=0.95, seed=int(rng.integers(0, 2**31)))
        bodies.append(body)

    def run(body):
        chunks = list(client.completions.create(model=folder.name, stream=True,
                                                stream_options={"include_usage": True}, **body))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        return text, [c.choices[0].finish_reason for c in chunks if c.choices][-1], chunks[-1].usage.completion_tokens

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        got = list(pool.map(run, bodies))
    assert got == [solo(b, chat=False) for b in bodies]


def test_disconnect_frees_the_slot(folder, server, client, solo):
    aborted = metric(server, 'lockstep_requests_total{finish_reason="abort"}')
    stream = client.completions.create(model=folder.name, prompt="a long one", max_tokens=CAPACITY - 20, stream=True)
    next(iter(stream))
    stream.close()
    deadline = time.monotonic() + 20
    while metric(server, "lockstep_running_requests") > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(server, "lockstep_running_requests") == 0
    assert metric(server, 'lockstep_requests_total{finish_reason="abort"}') == aborted + 1
    body = {"prompt": "next", "max_tokens": 12}
    whole = client.completions.create(model=folder.name, **body)
    assert (whole.choices[0].text, whole.choices[0].finish_reason, whole.usage.completion_tokens) == \
        solo(body, chat=False)


@pytest.mark.parametrize("body, word", [
    (b"{not json", "not valid JSON"),
    (json.dumps({"model": "nope", "prompt": "x"}).encode(), "does not exist"),
    (json.dumps({"model": "MODEL", "messages": []}).encode(), "messages"),
    (json.dumps({"model": "MODEL", "prompt": "x", "temperature": 7}).encode(), "temperature"),
    (json.dumps({"model": "MODEL", "prompt": "x", "max_tokens": 0}).encode(), "max_tokens"),
    (json.dumps({"model": "MODEL", "prompt": "x", "max_tokens": 10_000}).encode(), "positions"),
    (json.dumps({"model": "MODEL", "prompt": "x", "n": 2}).encode(), "n must be 1"),
    (json.dumps({"model": "MODEL", "prompt": ""}).encode(), "empty"),
])
def test_bad_input_is_a_400_and_the_server_serves_on(folder, server, client, body, word):
    path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
    status, _, answer = post(server, path, body.replace(b"MODEL", folder.name.encode()))
    assert status == 400 and word in answer["error"]["message"]
    assert answer["error"]["type"] == "invalid_request_error"
    assert client.completions.create(model=folder.name, prompt="ok", max_tokens=2).usage.completion_tokens == 2


def test_openai_client_raises_bad_request(folder, client):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=folder.name, messages=[{"role": "user", "content": "x"}], top_p=0)


def test_full_queue_is_a_429_with_retry_after(folder):
    proc, url = start_server(folder, "--max-batch", "1", "--capacity", str(CAPACITY), "--max-waiting", "1", cwd=ROOT)
    try:
        long = {"model": folder.name, "prompt": "x", "max_tokens": CAPACITY - 8, "stream": True}
        holders = []
        for _ in range(2):  # one runs, one waits
            conn = http.client.HTTPConnection(url.removeprefix("http://"), timeout=30)
            conn.request("POST", "/v1/completions", json.dumps(long), {"content-type": "application/json"})
            holders.append(conn)
        deadline = time.monotonic() + 20
        while metric(url, "lockstep_queue_depth") < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        status, headers, answer = post(url, "/v1/completions", json.dumps(dict(long, stream=False)).encode())
        assert status == 429 and headers.get("retry-after", headers.get("Retry-After")) == "1"
        assert answer["error"]["type"] == "rate_limit_error"
        for conn in holders:
            conn.close()
    finally:
        stop_server(proc)


def test_health_is_503_until_loaded_and_the_api_key_is_checked(folder):
    import uvicorn

    from core.serve.app import Server, make_app

    release = threading.Event()

    def load():
        assert release.wait(30)
        return Engine(Runner(folder, "cpu_reference"), max_batch=2, capacity=64).start()

    server = Server(load, "tiny", api_key="sekret")
    port = free_port()
    web = uvicorn.Server(uvicorn.Config(make_app(server), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=web.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        status = None
        while status is None and time.monotonic() < deadline:
            try:
                urllib.request.urlopen(url + "/health", timeout=2)
            except urllib.error.HTTPError as exc:
                status = exc.code
            except urllib.error.URLError:
                time.sleep(0.05)
        assert status == 503
        release.set()
        while server.engine is None and time.monotonic() < deadline:
            time.sleep(0.05)
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            assert r.status == 200
        wrong = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
        right = openai.OpenAI(base_url=url + "/v1", api_key="sekret", max_retries=0)
        assert right.completions.create(model="tiny", prompt="hi", max_tokens=3).usage.completion_tokens == 3
    finally:
        release.set()
        web.should_exit = True
        thread.join(20)


def test_metrics_count_what_was_served(folder, server, client):
    before = metric(server, "lockstep_generation_tokens_total")
    client.completions.create(model=folder.name, prompt="count me", max_tokens=5)
    assert metric(server, "lockstep_generation_tokens_total") == before + 5
    for name in ("lockstep_time_to_first_token_seconds_count", "lockstep_inter_token_latency_seconds_count",
                 "lockstep_request_latency_seconds_count", "lockstep_prompt_tokens_total"):
        assert metric(server, name) > 0, name
    assert metric(server, "lockstep_queue_depth") == 0 and metric(server, "lockstep_slot_usage") == 0
    assert metric(server, 'lockstep_requests_total{finish_reason="length"}') > 0


def test_logprobs_with_the_openai_client(folder, client):
    """Completions logprobs=1 and chat logprobs=true, whole and streamed: one entry per token,
    each the fp32 log-softmax of the solo run's logits (greedy: the top token is the chosen one)."""
    from core.engine.logprobs import chosen

    body = {"prompt": "The quick brown fox", "max_tokens": 6}
    session = Session(Runner(folder, "cpu_reference"), batch=1, capacity=CAPACITY, kv_policy="fixed")
    out = session.prefill([list(b"The quick brown fox")])
    want = []
    for _ in range(6):
        want.append(chosen(session.last_logits()[0], int(out.tokens[0])).logprob)
        out = session.step()
    whole = client.completions.create(model=folder.name, logprobs=1, **body)
    lp = whole.choices[0].logprobs
    assert lp.token_logprobs == want[:whole.usage.completion_tokens] and len(lp.tokens) == len(want)
    assert lp.top_logprobs == [{t: v} for t, v in zip(lp.tokens, lp.token_logprobs)]
    assert lp.text_offset == list(range(len(lp.tokens)))  # one byte a token
    streamed = list(client.completions.create(model=folder.name, logprobs=0, stream=True, **body))
    assert [v for c in streamed if c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs] == want
    chat = {"messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 5}
    answer = client.chat.completions.create(model=folder.name, logprobs=True, top_logprobs=0, **chat)
    entries = answer.choices[0].logprobs.content
    assert len(entries) == answer.usage.completion_tokens and all(e.logprob <= 0 for e in entries)
    assert all(e.bytes == list(e.token.encode()) and e.top_logprobs == [] for e in entries)
    chunks = list(client.chat.completions.create(model=folder.name, logprobs=True, stream=True, **chat))
    assert [e.logprob for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content] \
        == [e.logprob for e in entries]
    assert client.completions.create(model=folder.name, **body).choices[0].logprobs is None


@pytest.mark.parametrize("path, extra, word", [
    ("/v1/completions", {"prompt": "x", "logprobs": 2}, "logprobs must be an integer in [0, 1]"),
    ("/v1/completions", {"prompt": "x", "logprobs": True}, "logprobs must be an integer"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 3},
     "top_logprobs must be 0"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 0},
     "needs logprobs: true"),
])
def test_logprobs_beyond_the_limit_are_a_400(folder, server, path, extra, word):
    status, _, answer = post(server, path, json.dumps(dict(extra, model=folder.name)).encode())
    assert status == 400 and word in answer["error"]["message"]


@pytest.mark.parametrize("flags, match", [
    (("--capacity", "100000"), "capacity"),
    (("--device-budget", "1"), "budget"),
])
def test_a_model_that_fails_to_load_stops_the_server_with_one_line_and_status_2(folder, flags, match):
    """A setting only the load can judge (a capacity past the model's context, a budget too
    small) ends `lockstep serve` with its named error and status 2, not a server left up
    answering 503 (the port opened first: the load runs in the app's lifespan)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "core", "serve", str(folder), "--port", "0",
                           "--log-level", "warning", *flags], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("lockstep serve: error:") and match in last, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
