"""The cuda provider's switches from environment variables (docs/cuda.md), parsed in one place:
a value that is not a switch is an error that names the variable, never a silent default.

On/off switches take 1/0, true/false, yes/no or on/off (any case); unset or empty means the
default.
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
