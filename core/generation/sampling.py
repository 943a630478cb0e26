"""Sampling options, the counter-based generator and the reference sampler.

What a sampled row draws is a pure function of its logits, its options, its token history and
``(seed, position)``, never of the batch, the step count or the provider:

- **Options** (:class:`SamplingParams`) use the names and meanings of ONNX Runtime GenAI and
  transformers (``do_sample``, ``temperature``, ``top_k``, ``top_p``, ``min_p``,
  ``repetition_penalty``, ``seed``); defaults come from the model's genai_config.json "search"
  section (:func:`search_defaults`). Greedy (``do_sample=False``) is the default.
- **Randomness**: Philox-4x32-10 (Salmon et al., SC'11; the generator of cuRAND and
  JAX), key = the row's 64-bit seed, counter = ``(v // 4, position, 0, 0)``: vocabulary entry
  ``v`` of the token chosen for sequence index ``position`` takes word ``v % 4``. ``position``
  is the row's KV length when the token is chosen, so a continued row draws what a fresh run
  over the same history draws.
- **Draw**: the Gumbel-max trick: token = argmax over the kept entries of
  ``float64(z_v) - log(-log(u_v))``, ``u_v = (word + 0.5) / 2**32``. An argmax is exact and
  order-free, so a CUDA kernel gives the same token as :func:`sample_rows` on the same logits
  (everything past the fp32 ``z`` is float64).

The filter, per row (transformers' order: penalty, temperature, top-k, top-p, min-p):

1. a row holding NaN or infinity: ``[-1, 1]`` (flagged, as in ``device_argmax``);
2. repetition penalty ``r`` on tokens of the history (prompt and fed tokens):
   ``l < 0 ? l * r : l / r`` in fp32;
3. greedy rows (``do_sample=False`` or ``temperature == 0``): the argmax of the penalised
   logits, lowest index on ties (bitwise ``device_argmax`` when ``r == 1``);
4. ``z = l / temperature`` (fp32), ``m = max z``, ``e_v = exp(float64(z_v) - m)``;
5. top-k (``0 < k < V``): keep ``z_v >= `` the k-th largest ``z`` (ties at the boundary all kept,
   as transformers does);
6. top-p (``p < 1``): keep ``v`` when the mass of the kept entries with ``z`` strictly greater
   than ``z_v`` is ``< p`` times the kept mass (the most probable entry always stays; ties at
   the boundary stay or go together); masses are ``floor(e * 2**40)`` summed in int64
   (:data:`MASS_SCALE`), so every provider adds them exactly;
7. min-p (``> 0``): keep ``e_v >= min_p``;
8. the Gumbel-max draw over what is kept.
"""

from __future__ import annotations

import math
import secrets
from typing import Any, Mapping, Sequence

import attrs
import numpy as np

#: Option names accepted per row (GenAI / transformers names).
OPTION_NAMES = ("do_sample", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seed")

#: Layout of the per-row float parameters (``SamplingTensors.params``, float32 ``[B, 4]``).
P_TEMPERATURE, P_TOP_P, P_MIN_P, P_PENALTY = 0, 1, 2, 3
#: Layout of the per-row integer options (``SamplingTensors.options``, int32 ``[B, 4]``).
O_FLAGS, O_TOP_K, O_SEED_LO, O_SEED_HI = 0, 1, 2, 3
#: Bits of ``options[b, O_FLAGS]``: the row samples; the row applies the repetition penalty.
FLAG_SAMPLE, FLAG_PENALTY = 1, 2

_PHILOX_M = (np.uint64(0xD2511F53), np.uint64(0xCD9E8D57))
_PHILOX_W = (0x9E3779B9, 0xBB67AE85)
_MASK32 = np.uint64(0xFFFFFFFF)


class SamplingError(ValueError):
    """Bad sampling options (an unknown name, a value out of range); raised before any work.
    The session turns it into a :class:`core.session.RequestError`."""


@attrs.frozen
class SamplingParams:
    """Sampling options of one row.

    Attributes:
        do_sample: draw from the filtered distribution; False (the default) is greedy.
        temperature: > 0 divides the logits; 0 means greedy. Must be >= 0 and finite.
        top_k: keep the k most probable tokens (ties at the k-th kept); 0 disables.
        top_p: nucleus mass in (0, 1]; 1 disables.
        min_p: keep tokens at least ``min_p`` times as probable as the best, in [0, 1]; 0 disables.
        repetition_penalty: > 0; tokens of the row's history are penalised by it
            (transformers' rule); 1 disables. Applies to greedy rows too.
        seed: 64-bit unsigned seed of the row's random stream; None draws one when the
            request starts (see :meth:`with_seed`).
    """

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 50
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None

    @property
    def samples(self) -> bool:
        """True when the row draws at random (do_sample with a positive temperature)."""
        return self.do_sample and self.temperature > 0

    @property
    def greedy_plain(self) -> bool:
        """True when the row is plain greedy: ``device_argmax`` gives its token."""
        return not self.samples and self.repetition_penalty == 1.0

    def with_seed(self) -> SamplingParams:
        """These options with a seed: the given one, or a fresh random one for a sampled row."""
        if self.seed is not None or not self.samples:
            return self
        return attrs.evolve(self, seed=secrets.randbits(64))

    def to_dict(self) -> dict:
        """The options as plain data."""
        return attrs.asdict(self)


#: The smallest positive temperature, top_p and repetition_penalty taken (and 1 / it the largest
#: penalty): float32 rounds smaller ones to nothing (a top_p of 0 keeps no token) or makes
#: logits / temperature or a penalty overflow to infinity.
MIN_POSITIVE = 1e-6


def _number(name: str, value: Any, integer: bool = False) -> float:
    ok = isinstance(value, (int, np.integer)) if integer else isinstance(value, (int, float, np.integer, np.floating))
    if isinstance(value, bool) or not ok:
        kind = "an integer" if integer else "a number"
        raise SamplingError(f"sampling option {name} must be {kind}, got {value!r}")
    if not integer and not math.isfinite(float(value)):
        raise SamplingError(f"sampling option {name} must be finite, got {value!r}")
    return value


def make_params(options: Mapping[str, Any] | SamplingParams | None,
                defaults: SamplingParams | None = None) -> SamplingParams:
    """Validated :class:`SamplingParams` from a dict of options over ``defaults``.

    Raises:
        SamplingError: an unknown option name, a wrong type, or a value out of range
            (temperature < 0 or in (0, MIN_POSITIVE), top_p outside [MIN_POSITIVE, 1],
            top_k < 0, min_p outside [0, 1], repetition_penalty outside [MIN_POSITIVE, 1 / MIN_POSITIVE],
            seed outside [0, 2**64)).
    """
    base = defaults or SamplingParams()
    if options is None:
        return base
    if isinstance(options, SamplingParams):
        options = attrs.asdict(options)
    if not isinstance(options, Mapping):
        raise SamplingError(f"sampling options must be a dict, got {type(options).__name__}")
    unknown = sorted(set(options) - set(OPTION_NAMES))
    if unknown:
        raise SamplingError(f"unknown sampling option {', '.join(map(repr, unknown))}; known: "
                            f"{', '.join(OPTION_NAMES)}")
    values = attrs.asdict(base)
    values.update(options)
    if not isinstance(values["do_sample"], (bool, np.bool_)):
        raise SamplingError(f"sampling option do_sample must be True or False, got {values['do_sample']!r}")
    t = float(_number("temperature", values["temperature"]))
    if t < 0 or 0 < t < MIN_POSITIVE:
        raise SamplingError(f"temperature must be >= 0 (0: greedy; a positive one at least {MIN_POSITIVE:g}), got {t}")
    k = int(_number("top_k", values["top_k"], integer=True))
    if k < 0:
        raise SamplingError(f"top_k must be >= 0 (0 disables it), got {k}")
    p = float(_number("top_p", values["top_p"]))
    if not MIN_POSITIVE <= p <= 1:
        raise SamplingError(f"top_p must be in (0, 1] and at least {MIN_POSITIVE:g}, got {p}")
    mp = float(_number("min_p", values["min_p"]))
    if not 0 <= mp <= 1:
        raise SamplingError(f"min_p must be in [0, 1], got {mp}")
    r = float(_number("repetition_penalty", values["repetition_penalty"]))
    if not MIN_POSITIVE <= r <= 1 / MIN_POSITIVE:  # float32 makes a smaller one 0, a larger one inf
        raise SamplingError(f"repetition_penalty must be > 0 (in [{MIN_POSITIVE:g}, {1 / MIN_POSITIVE:g}]), got {r}")
    seed = values["seed"]
    if seed is not None:
        seed = int(_number("seed", seed, integer=True))
        if not 0 <= seed < 1 << 64:
            raise SamplingError(f"seed must be in [0, 2**64), got {seed}")
    return SamplingParams(bool(values["do_sample"]), t, k, p, mp, r, seed)


def search_defaults(search: Mapping[str, Any] | None) -> SamplingParams:
    """Defaults from genai_config.json's "search" section (``do_sample``, ``temperature``,
    ``top_k``, ``top_p``, ``min_p``, ``repetition_penalty``, ``random_seed``; others ignored).
    ``random_seed`` of -1 (GenAI's "random") means no fixed seed.

    Raises:
        SamplingError: a value there is out of range (the message names the option).
    """
    search = dict(search or {})
    picked = {k: search[k] for k in OPTION_NAMES if k in search and k != "seed"}
    seed = search.get("random_seed")
    if isinstance(seed, int) and not isinstance(seed, bool) and seed >= 0:
        picked["seed"] = seed
    try:
        return make_params(picked)
    except SamplingError as exc:
        raise SamplingError(f"genai_config.json search: {exc}") from None


def resolve_rows(sampling: Any, batch: int, defaults: SamplingParams) -> list[SamplingParams]:
    """One validated, seeded :class:`SamplingParams` per row.

    Args:
        sampling: None (the defaults for every row), one dict / SamplingParams for every row, or a
            list of ``batch`` of them (None entries take the defaults).
        batch: rows in the request.
        defaults: the model's defaults (:func:`search_defaults`).

    Raises:
        SamplingError: bad options, or a list of the wrong length.
    """
    if sampling is None or isinstance(sampling, (Mapping, SamplingParams)):
        rows = [sampling] * batch
    elif isinstance(sampling, Sequence) and not isinstance(sampling, (str, bytes)):
        rows = list(sampling)
        if len(rows) != batch:
            raise SamplingError(f"sampling has {len(rows)} {'entry' if len(rows) == 1 else 'entries'} for "
                                f"{batch} {'row' if batch == 1 else 'rows'}")
    else:
        raise SamplingError(f"sampling must be a dict, a SamplingParams or a list of them, got {sampling!r:.60}")
    out = []
    for b, row in enumerate(rows):
        try:
            out.append(make_params(row, defaults).with_seed())
        except SamplingError as exc:
            raise SamplingError(f"row {b}: {exc}") if batch > 1 else exc from None
    return out


def pack(params: Sequence[SamplingParams]) -> tuple[np.ndarray, np.ndarray]:
    """The device form of per-row options: (float32 ``[B, 4]`` params, int32 ``[B, 4]`` options)
    in the layouts ``P_*`` / ``O_*``; seeds split into two 32-bit words (bit patterns in int32)."""
    f = np.zeros((len(params), 4), np.float32)
    i = np.zeros((len(params), 4), np.int32)
    for b, sp in enumerate(params):
        f[b] = (sp.temperature, sp.top_p, sp.min_p, sp.repetition_penalty)
        seed = sp.seed or 0
        flags = (FLAG_SAMPLE if sp.samples else 0) | (FLAG_PENALTY if sp.repetition_penalty != 1.0 else 0)
        top_k = min(sp.top_k, 0x7FFFFFFF)  # any k >= the vocabulary keeps every token: one int32 holds it
        words = np.array([flags, top_k, seed & 0xFFFFFFFF, seed >> 32], np.uint32)
        i[b] = words.view(np.int32)
    return f, i


# -- Philox-4x32-10 ---------------------------------------------------------------------------
def philox4x32(counter: np.ndarray, key: tuple[Any, Any], rounds: int = 10) -> np.ndarray:
    """Philox-4x32 of ``counter`` uint32 ``[..., 4]`` under ``key`` (two uint32 words, ints or
    arrays broadcastable to ``counter[..., 0]``).

    Returns:
        uint32 ``[..., 4]``; matches the Random123 known-answer vectors (tests/unit).
    """
    c = [np.asarray(counter[..., j], np.uint64) for j in range(4)]
    k0 = np.asarray(key[0], np.uint64) & _MASK32
    k1 = np.asarray(key[1], np.uint64) & _MASK32
    w0, w1 = np.uint64(_PHILOX_W[0]), np.uint64(_PHILOX_W[1])
    for _ in range(rounds):
        p0 = _PHILOX_M[0] * c[0]
        p1 = _PHILOX_M[1] * c[2]
        hi0, lo0 = p0 >> np.uint64(32), p0 & _MASK32
        hi1, lo1 = p1 >> np.uint64(32), p1 & _MASK32
        c = [hi1 ^ c[1] ^ k0, lo1, hi0 ^ c[3] ^ k1, lo0]
        k0, k1 = (k0 + w0) & _MASK32, (k1 + w1) & _MASK32
    return np.stack(c, axis=-1).astype(np.uint32)


def uniform_words(seed: Any, position: Any, vocab: int) -> np.ndarray:
    """uint32 ``[..., vocab]``: the random word of every vocabulary entry for the token chosen
    at sequence index ``position`` of a row seeded ``seed`` (counter ``(v // 4, position, 0,
    0)``). ``seed`` and ``position`` are ints or equal-shaped arrays (one entry per row)."""
    seed = np.asarray(seed, np.uint64)
    position = np.asarray(position, np.uint64)
    blocks = -(-vocab // 4)
    ctr = np.zeros(position.shape + (blocks, 4), np.uint64)
    ctr[..., 0] = np.arange(blocks, dtype=np.uint64)
    ctr[..., 1] = (position & _MASK32)[..., None]
    key = ((seed & _MASK32)[..., None], (seed >> np.uint64(32))[..., None])
    words = philox4x32(ctr, key)
    return words.reshape(position.shape + (blocks * 4,))[..., :vocab]


def gumbel(words: np.ndarray) -> np.ndarray:
    """float64 Gumbel noise ``-log(-log(u))`` of uint32 ``words``, ``u = (w + 0.5) / 2**32``."""
    u = (words.astype(np.float64) + 0.5) * (1.0 / 4294967296.0)
    return -np.log(-np.log(u))


# -- the reference sampler ----------------------------------------------------------------------
def penalize(row: np.ndarray, history: np.ndarray, penalty: float) -> np.ndarray:
    """fp32 logits ``row`` [V] with ``penalty`` applied where ``history`` [V] is set."""
    r = np.float32(penalty)
    hit = np.asarray(history, bool)
    return np.where(hit, np.where(row < 0, row * r, row / r), row).astype(np.float32)


#: Top-p masses are sums of ``floor(e_v * 2**40)`` in 64-bit integers: exact, so the order a
#: device adds them in cannot change the kept set (an entry below 2**-40 of the best weighs 0).
MASS_SCALE = float(1 << 40)


def kept_mask(z: np.ndarray, top_k: int, top_p: float, min_p: float) -> tuple[np.ndarray, np.ndarray]:
    """The filter of steps 4 to 7 (module docstring) on fp32 ``z`` [V]: (kept bool [V],
    float64 ``e`` [V] relative probabilities, 1 at the maximum)."""
    v = z.shape[0]
    z = z + np.float32(0.0)  # -0.0 -> +0.0: keys and comparisons agree on zeros
    zd = z.astype(np.float64)
    e = np.exp(zd - zd.max())
    keep = np.ones(v, bool)
    if 0 < top_k < v:
        keep &= z >= np.partition(z, v - top_k)[v - top_k]
    if top_p < 1.0:
        idx = np.flatnonzero(keep)
        vals = z[idx]
        order = np.argsort(-vals, kind="stable")
        sv = vals[order]
        mass = np.floor(e[idx][order] * MASS_SCALE).astype(np.int64)
        before = np.concatenate([[0], np.cumsum(mass)])   # before[j]: mass of sorted entries < j
        first = np.searchsorted(-sv, -sv, side="left")    # first sorted index of each tie group
        greater = before[first].astype(np.float64)        # mass strictly more probable
        limit = np.float64(np.float32(top_p)) * np.float64(before[-1])
        keep[idx[order[~(greater < limit)]]] = False
    if min_p > 0.0:
        keep &= e >= np.float64(np.float32(min_p))
    return keep, e


def sample_row(row: np.ndarray, history: np.ndarray | None, params: SamplingParams, position: int,
               words: np.ndarray | None = None) -> tuple[int, int]:
    """``(token, error)`` for one row of fp32 logits ``row`` [V] (the module's algorithm).

    Args:
        row: the logits the token is chosen from.
        history: bool/uint8 [V], the tokens of the row's history (only read with a penalty).
        params: the row's options (a sampled row needs a seed: :meth:`SamplingParams.with_seed`).
        position: the sequence index of the token being chosen (the row's KV length).
        words: ``uniform_words(seed, position, V)`` when already computed.
    """
    row = np.asarray(row, np.float32)
    if not np.isfinite(row).all():
        return -1, 1
    if params.repetition_penalty != 1.0 and history is not None:
        row = penalize(row, history, params.repetition_penalty)
    if not params.samples:
        return int(np.argmax(row)), 0
    z = (row / np.float32(params.temperature)).astype(np.float32)
    keep, _ = kept_mask(z, params.top_k, params.top_p, params.min_p)
    if words is None:
        words = uniform_words(params.seed or 0, position, z.shape[0])
    score = z.astype(np.float64) + gumbel(words)
    return int(np.argmax(np.where(keep, score, -np.inf))), 0


def unpack(params: np.ndarray, options: np.ndarray) -> list[SamplingParams]:
    """Inverse of :func:`pack` (what a host implementation of ``device_sample`` reads)."""
    out = []
    words = np.asarray(options).view(np.uint32)
    for f, w in zip(np.asarray(params, np.float32), words):
        flags, k, lo, hi = (int(x) for x in w)
        out.append(SamplingParams(bool(flags & FLAG_SAMPLE), float(f[P_TEMPERATURE]), k, float(f[P_TOP_P]),
                                  float(f[P_MIN_P]), float(f[P_PENALTY]) if flags & FLAG_PENALTY else 1.0,
                                  lo | (hi << 32)))
    return out


def sample_rows(rows: np.ndarray, params: np.ndarray, options: np.ndarray, counter: np.ndarray,
                history: np.ndarray | None) -> np.ndarray:
    """The reference ``device_sample`` on host arrays: int32 ``[B, 2]`` ``[token, error]``.

    Args:
        rows: fp32 logits ``[B, V]`` (each row's chosen sequence position already selected).
        params, options: float32 ``[B, 4]`` / int32 ``[B, 4]`` from :func:`pack`.
        counter: int ``[B]``: each row's sequence index of the token being chosen.
        history: uint8 ``[B, V]`` token history (read for rows with the penalty flag), or None.
    """
    out = np.empty((rows.shape[0], 2), np.int32)
    rows_params = unpack(params, options)
    seeds = np.array([sp.seed or 0 for sp in rows_params], np.uint64)
    counter = np.asarray(counter).astype(np.int64)
    words = uniform_words(seeds, counter, rows.shape[1])  # every row's words in one Philox call
    for b, sp in enumerate(rows_params):
        out[b] = sample_row(rows[b], None if history is None else history[b], sp, int(counter[b]), words[b])
    return out
