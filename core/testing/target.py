"""What the parity kit runs against: a provider, a model, seeds and the exclusion rules.

A :class:`KitTarget` is made by the pytest plugin from its command-line options (or by a
project's conftest, e.g. Lockstep's own tests/conformance); the kit's tests
(:mod:`core.testing.suite`) take it from the ``lockstep_target`` fixture.
"""

from __future__ import annotations

import fnmatch
import tempfile
import zlib
from pathlib import Path
from typing import Any

import attrs
import numpy as np

#: Exclusion kinds: "exclude" skips the case with its reason, "xfail" expects it to fail (strict).
KINDS = ("exclude", "xfail")


@attrs.frozen
class Rule:
    """One exclusion: ``pattern`` (fnmatch over the kit id, e.g. "op/MatMulNBits/*/float16"),
    its ``kind``, the ``reason`` shown in the report, and where it came from."""

    kind: str
    pattern: str
    reason: str
    source: str = "command line"

    @classmethod
    def parse(cls, kind: str, text: str, source: str = "command line") -> Rule:
        """``PATTERN=REASON`` -> Rule.

        Raises:
            ValueError: no "=" or an empty reason (every exclusion carries its reason).
        """
        pattern, sep, reason = text.partition("=")
        if not sep or not reason.strip() or not pattern.strip():
            raise ValueError(f"--lockstep-{kind} needs PATTERN=REASON, got {text!r}")
        return cls(kind, pattern.strip(), reason.strip(), source)


@attrs.define
class KitTarget:
    """The provider under test and how to run the kit against it.

    Attributes:
        provider_name: registered provider name (or a provider object).
        model_dir: builder model folder for the decode gates; None builds the tiny random model.
        batches, steps: decode-gate sizes (:func:`core.testing.parity.run_parity`).
        seed: base seed of the random inputs; each case draws from (seed, crc32(kit id)).
        rules: exclusions from the command line; the provider's own ``parity_exclusions`` and
            ``parity_xfail`` (dicts pattern -> reason, optional attributes) are added on creation.
        reference_name: the oracle provider.
    """

    provider_name: Any
    model_dir: Path | None = None
    batches: tuple[int, ...] = (1, 2, 8)
    steps: int = 64
    seed: int = 0
    rules: list[Rule] = attrs.field(factory=list)
    reference_name: str = "cpu_reference"
    _provider: Any = None
    _reference: Any = None
    _parity: Any = None
    _parity_error: BaseException | None = None
    _tmp: Any = None

    def provider(self):
        """The provider under test (created once; its declared exclusions join ``rules``)."""
        if self._provider is None:
            from core.plugins import get_provider

            self._provider = get_provider(self.provider_name)
            for kind, attr in (("exclude", "parity_exclusions"), ("xfail", "parity_xfail")):
                for pattern, reason in (getattr(self._provider, attr, None) or {}).items():
                    self.rules.append(Rule(kind, pattern, reason, f"provider {self._provider.name!r}"))
        return self._provider

    def reference(self):
        """A separate instance of the oracle provider."""
        if self._reference is None:
            from core.plugins import get_provider

            self._reference = get_provider(self.reference_name)
        return self._reference

    def rng(self, kit_id: str) -> np.random.Generator:
        """Random inputs of one case: fresh per seed, reproducible with --lockstep-seed."""
        return np.random.default_rng([self.seed, zlib.crc32(kit_id.encode())])

    def rule_for(self, kit_id: str) -> Rule | None:
        """The first rule matching ``kit_id`` (exclusions before xfails), or None."""
        self.provider()
        for kind in KINDS:
            for rule in self.rules:
                if rule.kind == kind and fnmatch.fnmatchcase(kit_id, rule.pattern):
                    return rule
        return None

    def model(self) -> Path:
        """The decode-gate model folder (the tiny random fp32 model unless one was given)."""
        if self.model_dir is None:
            from core.testing.tiny_model import make_tiny_model

            self._tmp = tempfile.TemporaryDirectory(prefix="lockstep-tiny-")
            self.model_dir = make_tiny_model(Path(self._tmp.name) / "tiny")
        return Path(self.model_dir)

    def parity(self):
        """The :class:`~core.testing.parity.ParityReport`, computed once and shared by the gate tests."""
        if self._parity is None and self._parity_error is None:
            from core.testing.parity import run_parity

            try:
                self._parity = run_parity(self.model(), self.provider(), self.batches, self.steps,
                                          reference=self.reference_name)
            except Exception as exc:  # noqa: BLE001 - re-raised in every gate test
                self._parity_error = exc
        if self._parity_error is not None:
            raise self._parity_error
        return self._parity
