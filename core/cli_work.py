"""What the ``lockstep`` commands do around the work itself: the BLAS threads they run with,
kernel compiles shown as their own step, and Ctrl-C that keeps what was made (used by
:mod:`core.cli`)."""

from __future__ import annotations

import argparse
import contextlib
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape

from core.threads import blas_threads, choose, requested

if TYPE_CHECKING:
    from core.generation.chat import Conversation
    from core.generation.generate import Result
    from core.generation.stream import Delta


@contextlib.contextmanager
def cpu_threads(a: argparse.Namespace) -> Iterator[None]:
    """The BLAS thread limit of a command that has ``--threads`` (:func:`core.threads.choose`),
    kept in ``a.cpu_threads`` for ``--json``; other commands run unlimited."""
    if not hasattr(a, "threads"):
        yield
        return
    a.cpu_threads = choose(a.provider, a.command, requested(a.threads))
    with blas_threads(a.cpu_threads):
        yield


def prompt_numbers(message: str, count: int) -> str:
    """A library message about ``prompt i`` (counted from 0) as the command line counts its
    prompts: "the prompt" when there is one, else "prompt i+1 of n"."""
    if count == 1:
        return re.sub(r"\b[Pp]rompt 0\b", "the prompt", message)
    return re.sub(r"\b([Pp]rompt) (\d+)\b", lambda m: f"{m[1]} {int(m[2]) + 1} of {count}", message)


@contextlib.contextmanager
def compiles(a: argparse.Namespace, show: Callable[[str, str], None] | None = None) -> Iterator[None]:
    """Inside the block, each kernel compile (:mod:`core.compiling`) is passed to ``show`` and
    its cache folder kept in ``a.compile_cache`` for the report."""
    from core import compiling

    def seen(what: str, cache: str) -> None:
        a.compile_cache = cache
        if show is not None:
            show(what, cache)

    with compiling.listen(seen):
        yield


def drain(a: argparse.Namespace, st, on_delta: Callable[[Delta], None]) -> tuple[Result, bool]:
    """Run ``st`` to its end, passing each delta to ``on_delta``; the first Ctrl-C stops it
    after the current step and keeps the rows made so far (finish reason "interrupted").
    Returns (the Result, whether it was interrupted); the ranks of --tensor-parallel are
    stopped either way."""
    from core.generation.interrupt import CtrlC

    interrupted = False
    try:
        deltas = iter(st)
        with CtrlC() as ctrl_c:
            for d in deltas:
                on_delta(d)
                if ctrl_c.pressed:
                    deltas.close()
                    for last in st.interrupt():
                        on_delta(last)
                    interrupted = True
                    break
        return st.result(), interrupted
    finally:
        if a.tensor_parallel != 1:  # stop the rank processes now, not when they are collected
            st.close_ranks()


def reply(talk: Conversation, line: str, console: Console) -> None:
    """One chat turn streamed to stdout; the first Ctrl-C stops the reply after the current
    step and keeps it, as far as it got, in the conversation."""
    from core.generation.interrupt import CtrlC

    with CtrlC() as ctrl_c:
        deltas = talk.say(line)
        for d in deltas:
            sys.stdout.write(d.text)
            sys.stdout.flush()
            if ctrl_c.pressed:
                deltas.close()
                sys.stdout.write("".join(last.text for last in talk.interrupt()))
                print(flush=True)
                console.print("[dim](reply stopped; the conversation goes on)[/dim]")
                return
    print(flush=True)


def compile_ahead(path: Path, console: Console, status: Callable) -> None:
    """``prepare --target cuda``: compile the cuda kernels of the model now, where a GPU is
    usable, so that the first run's prefill does not wait for them; else say why not."""
    from core import compiling
    from core.plugins import ProviderError, get_provider

    try:
        provider = get_provider("cuda")
    except ProviderError as exc:
        console.print(f"[dim]cuda kernels not compiled ahead ({escape(str(exc))}); the first cuda run "
                      "compiles them[/dim]")
        return
    with status("compiling cuda kernels for this model (first run only)") as update, \
            compiling.listen(lambda what, cache: update(f"compiling cuda kernels, first run only, cached in "
                                                         f"{cache}: {what}")):
        spent = compiling.warm(path, provider)
    console.print(f"[dim]cuda kernels ready ({spent:.1f} s of compiling)[/dim]")


def check_expert_budget(a: argparse.Namespace) -> None:
    """``--expert-budget`` (where the command has it) read before any model work: bytes, a size
    or a fraction of the experts' bytes; not with ``--tensor-parallel``.

    Raises:
        core.session.RequestError: a budget that reads as none, worded with its flag.
    """
    from core.runtime.residency import BudgetError, parse_budget
    from core.session import RequestError

    value = getattr(a, "expert_budget", None)
    if value is None:
        return
    try:
        parse_budget(value, 1 << 40)
    except BudgetError as exc:
        raise RequestError(f"--expert-budget: {exc}") from None
    if getattr(a, "tensor_parallel", 1) != 1:
        raise RequestError("--expert-budget runs on one device: drop --tensor-parallel")


def expert_runner(a: argparse.Namespace, model, provider):
    """``model`` itself, or under ``--expert-budget`` the Runner that pages its experts (with
    ``--weight-budget`` / ``--device-budget`` as one budget: core.runtime.expert_budget).

    Raises:
        core.session.RequestError: the budgets cannot work (the smallest working one named), or
            the model has no MoE node.
    """
    if getattr(a, "expert_budget", None) is None:
        return model
    from core.runtime.residency import BudgetError
    from core.runtime.runner import Runner
    from core.session import RequestError

    try:
        return Runner(model, provider, a.layout or "head_major", weight_budget=a.weight_budget,
                      device_budget=a.device_budget, expert_budget=a.expert_budget)
    except (BudgetError, ValueError) as exc:
        raise RequestError(f"--expert-budget: {exc}") from None


def tcp_port(text: str) -> int:
    """``--port``: a TCP port, 0 (any free one) to 65535."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a port number, got {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port in [0, 65535], got {text}")
    return port
