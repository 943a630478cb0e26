"""`lockstep serve` as a subprocess on loopback, for tests and benchmarks."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str | Path, *flags: str, timeout: float = 120,
                 cwd: str | Path | None = None) -> tuple[subprocess.Popen, str]:
    """Start ``python -m core serve MODEL --port P FLAGS`` on a free loopback port and wait for
    /health to answer 200; returns the process and the base URL.

    Raises:
        RuntimeError: the server exited (its output's tail in the message) or was not ready
            within ``timeout`` seconds (it is killed then).
    """
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "core", "serve", str(model), "--port", str(port),
                             "--log-level", "warning", *flags], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            out = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
            raise RuntimeError(f"the server exited with {proc.returncode}: {out[-2000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"the server was not ready within {timeout} s")


def stop_server(proc: subprocess.Popen) -> None:
    """Stop a server from :func:`start_server` (SIGTERM, then SIGKILL after 20 s)."""
    proc.terminate()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
