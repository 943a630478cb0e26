"""The cuda provider's tuning: every ``LOCKSTEP_CUDA_*`` switch in one frozen object.

A :class:`Tuning` is read once from the environment (:meth:`Tuning.from_env`, when a
:class:`~providers.cuda.provider.CudaProvider` is made) or constructed (tests, benchmarks), and
passed in: the provider keeps it as ``provider.tuning`` and the launchers read it through their
kernel context (``ctx.provider.tuning``). ``provider.settings()`` reports it, so ``lockstep
profile`` prints and records what it measured. None of the switches changes an output bit.
:data:`providers.cuda.env.SWITCHES` holds each switch's variable, default and accepted values.
"""

from __future__ import annotations

import attrs

from providers.cuda import env

#: field name -> its environment variable (the name after the project and provider prefix, lower case)
_VARS = {name.split("_", 2)[2].lower(): name for name in env.SWITCHES}


def _var(field: str) -> str:
    return _VARS[field]


def _default(field: str):
    return env.SWITCHES[_var(field)][0]


def _choices(field: str):
    return attrs.validators.in_(env.SWITCHES[_var(field)][1])


@attrs.frozen
class Tuning:
    """The switches of one cuda provider (docs/configuration.md; field ``gemm_wide`` is
    ``LOCKSTEP_CUDA_GEMM_WIDE``, and so on).

    Attributes:
        replay: eager launch replay for the plans the provider makes (providers/cuda/replay.py).
        pdl: programmatic dependent launch where the device can (kernels/pdl.cuh).
        pdl_rows: the most rows of a node whose launches take PDL: "1", "8", "16", "32", "all".
        gemm_pipeline: which GEMM launches take the PIPE weight-load schedule: "auto" (every
            int4 launch, and dense launches of one token tile per block or of two in one wave),
            "all" or "off". It pays where latency bounds the launch and loses on multi-tile
            dense kernels (registers).
        gemm_wide: which projections take the tiled kernels (``mma_wide``, ``mma_wide4``) from
            32 rows: "auto" (dense, and int4 from 64 rows), "dense", "all" or "off". A tile
            reads its weights once per 64 rows instead of once per 8-32.
        gemm_split: split-K of the int4 row kernel for long K at few rows: "auto" or "off".
        gemm_token_tiles: n8 token tiles per row-kernel block: "auto" (the measured rule,
            :func:`providers.cuda.ops._mma_schedule.row_nj`) or "1", "2", "4" (the most).
        gemm_gemv: int4 launches of 1-8 rows take ``gemv4`` (kernels/linear_gemv4.cu, bitwise
            ``mma_nbits4``; :mod:`providers.cuda.ops._gemv4`). Off until measured.
        attn_hint: ``gqa_decode`` may take its hinted prologue (up to 8 rows).
        attn_static_head: decode launches use the compile-time head size where it is 64 or 128.
        attn_ring: sliding_window_cache=1 nodes run on their ring (off: refused at load).

    Raises:
        ValueError: a choice outside its accepted values (attrs validators).
    """

    replay: bool = _default("replay")
    pdl: bool = _default("pdl")
    pdl_rows: str = attrs.field(default=_default("pdl_rows"), validator=_choices("pdl_rows"))
    gemm_pipeline: str = attrs.field(default=_default("gemm_pipeline"), validator=_choices("gemm_pipeline"))
    gemm_wide: str = attrs.field(default=_default("gemm_wide"), validator=_choices("gemm_wide"))
    gemm_split: str = attrs.field(default=_default("gemm_split"), validator=_choices("gemm_split"))
    gemm_token_tiles: str = attrs.field(default=_default("gemm_token_tiles"), validator=_choices("gemm_token_tiles"))
    gemm_gemv: bool = _default("gemm_gemv")
    attn_hint: bool = _default("attn_hint")
    attn_static_head: bool = _default("attn_static_head")
    attn_ring: bool = _default("attn_ring")

    @classmethod
    def from_env(cls) -> Tuning:
        """Every switch read from the environment now (unset or empty: the default).

        Raises:
            core.plugins.ProviderError: a value that is not accepted, naming the variable.
        """
        return cls(**{f.name: env.switch(_var(f.name)) for f in attrs.fields(cls)})

    def settings(self) -> dict[str, str]:
        """Field name -> value as text ("on"/"off" for the on/off switches), for reports."""
        return {f.name: ("on" if v else "off") if isinstance(v, bool) else str(v)
                for f, v in zip(attrs.fields(type(self)), attrs.astuple(self))}
