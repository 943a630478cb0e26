"""benchmarks/serve_load.py runs in one command against `lockstep serve` (a tiny model on
cpu_reference, a few requests) and, in the same invocation, the ONNX Runtime GenAI anchor where
``import onnxruntime_genai`` works: its last stdout line is one JSON object with throughput, TTFT
and ITL p50/p99 for both, and the solo-equivalence check finds no mismatch. No timing is asserted."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

from core.testing.tiny_model import TinyConfig, make_tiny_model, write_byte_tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def test_serve_load_reports_lockstep_and_the_ort_anchor_in_one_json(tmp_path):
    folder = write_byte_tokenizer(make_tiny_model(tmp_path / "m", config=TinyConfig(context=128)))
    cmd = [sys.executable, str(ROOT / "benchmarks" / "serve_load.py"), "--model", str(folder), "--provider",
           "cpu_reference", "--max-batch", "4", "--capacity", "64", "--rates", "40", "--requests", "6",
           "--prompt-len", "4,20", "--max-tokens", "4,12", "--check", "3", "--vocab", "200",
           "--json", str(tmp_path / "out.json")]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    line = json.loads(done.stdout.strip().splitlines()[-1])
    (rate,) = line["lockstep"]
    assert rate["requests"] == 6 and rate["tokens_per_s"] > 0
    assert set(rate["ttft_s"]) == set(rate["itl_s"]) == {"p50", "p99"}
    assert line["solo_check"] == {"checked": 3, "mismatches": 0}
    anchor = line["ort_genai"]
    if importlib.util.find_spec("onnxruntime_genai") is None:
        assert "skipped" in anchor
    else:
        assert anchor["requests"] == 6 and anchor["tokens_per_s"] > 0 and anchor["mode"] == "sequential"
        assert set(anchor["ttft_s"]) == set(anchor["itl_s"]) == {"p50", "p99"}
    full = json.loads((tmp_path / "out.json").read_text())
    assert full["ort_genai"]["requests" if "requests" in anchor else "skipped"]
