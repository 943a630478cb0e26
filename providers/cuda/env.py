"""The cuda provider's switches from environment variables (docs/cuda.md), parsed in one place:
a value that is not a switch is an error that names the variable, never a silent default.

On/off switches take 1/0, true/false, yes/no or on/off (any case); unset or empty means the
default. :data:`SWITCHES` lists every one with its default; :func:`check_all` parses them all, so
the provider refuses a bad value before it imports CuPy (the reason a user sees first).
"""

from __future__ import annotations

import os

_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")


def flag(name: str, default: bool) -> bool:
    """The on/off switch ``name``.

    Raises:
        core.plugins.ProviderError: a value that is not one of the accepted spellings.
    """
    raw = os.environ.get(name, "")
    value = raw.strip().lower()
    if not value:
        return default
    if value in _ON:
        return True
    if value in _OFF:
        return False
    from core.plugins import ProviderError

    raise ProviderError(f"{name} must be 1 or 0 (or true/false, yes/no, on/off), not {raw!r}")


def choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    """The switch ``name`` that takes one of ``choices`` (unset or empty: ``default``).

    Raises:
        core.plugins.ProviderError: another value.
    """
    value = os.environ.get(name, "").strip().lower() or default
    if value not in choices:
        from core.plugins import ProviderError

        raise ProviderError(f"{name} must be {' or '.join(repr(c) for c in choices)}, not "
                            f"{os.environ.get(name)!r}")
    return value


#: Every switch of the cuda provider (docs/cuda.md): name -> (default, choices), choices None for
#: an on/off switch.
SWITCHES: dict[str, tuple] = {
    "LOCKSTEP_CUDA_REPLAY": (True, None),
    "LOCKSTEP_CUDA_PDL": (True, None),
    "LOCKSTEP_CUDA_PDL_ROWS": ("16", ("1", "8", "16", "32", "all")),
    "LOCKSTEP_CUDA_GEMM_PIPELINE": ("auto", ("auto", "all", "off")),
    "LOCKSTEP_CUDA_GEMM_WIDE": ("auto", ("auto", "dense", "all", "off")),
    "LOCKSTEP_CUDA_GEMM_SPLIT": ("auto", ("auto", "off")),
    "LOCKSTEP_CUDA_GEMM_TOKEN_TILES": ("auto", ("auto", "1", "2", "4")),
    "LOCKSTEP_CUDA_GEMM_GEMV": (False, None),
    "LOCKSTEP_CUDA_ATTN_HINT": (True, None),
    "LOCKSTEP_CUDA_ATTN_STATIC_HEAD": (True, None),
    "LOCKSTEP_CUDA_ATTN_RING": (True, None),
}


def switch(name: str):
    """The value of switch ``name`` of :data:`SWITCHES` (a bool, or one of its choices).

    Raises:
        KeyError: ``name`` is not a cuda switch.
        core.plugins.ProviderError: its value is not accepted (:func:`flag`, :func:`choice`).
    """
    default, choices = SWITCHES[name]
    return flag(name, default) if choices is None else choice(name, default, choices)


def check_all() -> None:
    """Parse every switch of :data:`SWITCHES`.

    Raises:
        core.plugins.ProviderError: the first one whose value is not accepted, named.
    """
    for name in SWITCHES:
        switch(name)
