"""The argument types and hints of the ``lockstep`` command line (:mod:`core.cli`): number
parsers that refuse bad values with argparse's message, the library's option names worded as
flags, the closest flag to an unknown one, and the check that ``serve`` can listen where asked."""

from __future__ import annotations

import argparse
import errno
import math
import re


def int_arg(text: str, what: str) -> int:
    """``text`` as an int, or argparse's error saying it must be ``what``."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None


def positive_int(text: str) -> int:
    """An argparse type: an integer of 1 or more."""
    value = int_arg(text, "a positive integer")
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a finite number above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def non_negative_int(text: str) -> int:
    """An argparse type: an integer of 0 or more."""
    value = int_arg(text, "0 or more")
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


#: Request options the library names in its errors, and the flags that set them (main() rewords
#: the errors of run and chat with :func:`flag_names`).
FLAGS = ("max_new_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seed",
          "weight_budget", "device_budget", "do_sample", "stop", "tensor_parallel")


def flag_names(message: str) -> str:
    """A library error about a request option, worded with its flag (``top_p`` -> ``--top-p``)."""
    for name in FLAGS:
        message = re.sub(rf"(?<![\w-]){name}(?![\w])", "--" + name.replace("_", "-"), message)
    return message.replace("--do-sample=False", "--no-do-sample")


def int_list(text: str) -> list[int]:
    """An argparse type: comma-separated positive integers (``1,8,32``)."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def check_listen(host: str, port: int) -> None:
    """Refuse (RequestError) an address ``lockstep serve`` cannot listen on: in use, not this
    machine's or not an address, found before any model work (uvicorn would find it only after
    the model began loading, and exit with its own log line)."""
    import socket

    from core.session import RequestError

    where = f"{host}:{port}"
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                              flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as exc:
        raise RequestError(f"cannot listen on {where}: {getattr(exc, 'strerror', None) or exc}") from None
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind(address)
        except OSError as exc:
            hint = "; another server listens there: stop it or pick another --port" \
                if exc.errno == errno.EADDRINUSE else ""
            raise RequestError(f"cannot listen on {where}: {exc.strerror or exc}{hint}") from None


def unknown_hint(args, unknown: list[str]) -> str:
    """What to type instead of ``unknown`` arguments: the flag a mistyped or foreign one is
    closest to (``--max-tokens``: ``--max-new-tokens``), the positional model of plan and
    profile, or ``--prompt`` before a bare prompt of ``run`` (a flag's value is not one)."""
    import difflib

    flags = [u.split("=", 1)[0] for u in unknown if u.startswith("-")]
    if "--model" in flags:
        return f"; the model goes first, without --model: lockstep {args.command} MODEL"
    options = [o for action in args.command_parser._actions for o in action.option_strings if o.startswith("--")]
    for flag in flags:
        close = difflib.get_close_matches(flag, options, n=1, cutoff=0.75)
        if close:
            return f"; did you mean {close[0]}?"
    bare = [u for i, u in enumerate(unknown)
            if not u.startswith("-") and not (i and unknown[i - 1].startswith("-") and "=" not in unknown[i - 1])]
    if args.command == "run" and bare:
        return '; a prompt goes after --prompt, e.g. lockstep run --prompt "What is 2 + 2?"'
    return ""
