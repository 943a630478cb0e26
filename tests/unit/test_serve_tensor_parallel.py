"""`lockstep serve --tensor-parallel 2` against the official openai client: the sharded server's
greedy completions equal the single-rank server's, token for token (greedy tokens equal where
the top two logits differ by more than the tolerance of docs/parallel.md, which the tiny model's
do), and its logprobs are within that tolerance; a sampled request is a 400 (the ranks decode
greedily only) and the server serves on."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

from core.testing.serving import start_server, stop_server  # noqa: E402
from core.testing.tiny_model import TinyConfig, make_tiny_model, write_byte_tokenizer  # noqa: E402

CAPACITY = 256
PROMPTS = ["The quick brown fox", "Hello", "Name a colour, any colour at all.", "a"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_byte_tokenizer(make_tiny_model(tmp_path_factory.mktemp("serve_tp") / "m",
                                                config=TinyConfig(context=CAPACITY)))


@pytest.fixture(scope="module")
def clients(folder):
    """(single-rank client, tensor-parallel client, the latter's process id), each server a subprocess on loopback."""
    flags = ("--max-batch", "4", "--capacity", str(CAPACITY), "--prefill-chunk", "8")
    procs = []
    try:
        for extra in ((), ("--tensor-parallel", "2")):
            procs.append(start_server(folder, *flags, *extra, timeout=180))
        yield tuple(openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
                    for _, url in procs) + (procs[1][0].pid,)
    finally:
        for proc, _ in procs:
            stop_server(proc)


def _spawned(pid: int) -> list[str]:
    """The multiprocessing-spawned children of process ``pid`` (every thread's), by their command line."""
    kids = [c for task in Path(f"/proc/{pid}/task").iterdir() for c in (task / "children").read_text().split()]
    return [k for k in kids if "spawn_main" in Path(f"/proc/{k}/cmdline").read_text()]


def _complete(client, model: str, prompt: str, n: int) -> tuple[str, str, int, list[float]]:
    r = client.completions.create(model=model, prompt=prompt, max_tokens=n, temperature=0, logprobs=0)
    c = r.choices[0]
    return c.text, c.finish_reason, r.usage.completion_tokens, list(c.logprobs.token_logprobs)


def test_a_tensor_parallel_server_completes_as_the_single_rank_server(folder, clients):
    single, sharded, pid = clients
    assert len(_spawned(pid)) == 2  # the server's two rank processes
    for i, prompt in enumerate(PROMPTS):
        n = 6 + 5 * i  # lengths past one prefill chunk and across several decode steps
        want, got = _complete(single, folder.name, prompt, n), _complete(sharded, folder.name, prompt, n)
        assert got[:3] == want[:3] and got[2] == n
        assert np.allclose(got[3], want[3], rtol=0, atol=1e-4)
    streamed = sharded.completions.create(model=folder.name, prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                          stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == _complete(single, folder.name, PROMPTS[0],
                                                                                  12)[0]


def test_concurrent_requests_to_a_tensor_parallel_server_equal_their_single_rank_answers(folder, clients):
    import concurrent.futures

    single, sharded, _ = clients
    want = [_complete(single, folder.name, p, 10)[:3] for p in PROMPTS]
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(lambda p: _complete(sharded, folder.name, p, 10)[:3], PROMPTS))
    assert got == want


def test_a_sampled_request_to_a_tensor_parallel_server_is_a_400(folder, clients):
    _, sharded, _ = clients
    with pytest.raises(openai.BadRequestError, match="greedily only"):
        sharded.completions.create(model=folder.name, prompt="hi", max_tokens=4, temperature=0.8, seed=1)
    assert _complete(sharded, folder.name, "hi", 3)[2] == 3  # and it serves on
