"""Running the prompts of a prefill: last-position logits and pad-free length groups.

:func:`run_prompts` is the device part of :func:`core.runtime.step.prefill` before the argmax.
It runs the plan over right-padded prompts (GroupQueryAttention "first prompt",
docs/ops.md 1.4) in one of three ways:

- **all positions** (``all_logits=True``, or a plan without a last-position program): one run
  of the whole batch padded to the longest prompt; logits ``[B, S, V]``, the argmax reads
  position ``length_b - 1``;
- **last positions** (the default): the same run, fed :data:`core.fusion.LAST_INDEX` so the
  plan's last-position program gathers each row's last prompt position before the lm_head;
  logits ``[B, 1, V]``, the argmax reads position 0;
- **length groups** (when :func:`plan_groups` says padding would waste work): the rows are
  split into groups of similar length; each group runs alone, padded only to its own longest
  row, into scratch KV buffers of its own batch and length, whose live rows are then copied
  into the decode state's KV cache (:func:`core.runtime.kv.row_copies`); its logits rows are
  copied into one ``[B, 1, V]`` buffer. Every projection and norm computes each row alone and
  attention reads only the row's own positions (batch invariance), so a row's bits do not
  depend on its group: the result is bitwise the padded run's.

Grouping rule (:func:`plan_groups`): sort the rows by length, longest first; a group starts at
the longest row not yet placed, of length L, and takes every remaining row longer than L / 2
(so no row in a group is padded to more than twice its length). The groups are used when the
padded run would compute at least :data:`GROUP_GAIN` times the positions the groups compute,
``B * S >= GROUP_GAIN * sum_g(rows_g * S_g)``, so equal or similar lengths keep the single
padded run (one plan run, one weight read) and a batch of a long prompt and short ones is not
padded to the long one. The scratch KV buffers of a group are extra device memory while it
runs (at most the group's rows x its length); under a Runner's ``device_budget`` (which counts
every KV byte) prefill does not group.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from core.fusion import LAST_INDEX
from core.runtime import kv as kvgeo
from core.runtime import ring

#: The padded run must compute at least this many times the grouped positions to group.
GROUP_GAIN = 2.0
#: ``prefill_groups`` values of :class:`core.session.Session`.
GROUPING = ("auto", "off", "always")


def plan_groups(lengths: Sequence[int], grouping: str = "auto") -> list[list[int]] | None:
    """The length groups of a prefill (module docstring, "Grouping rule").

    Args:
        lengths: each row's prompt length (>= 1).
        grouping: "auto" (the groups only when they save :data:`GROUP_GAIN` times the
            work), "always" (the groups, even a single one: runs the grouped path whatever the
            lengths), "off" (never).

    Returns:
        Lists of row indices (each sorted ascending; groups from the longest rows down), or
        None for the single padded run.

    Raises:
        ValueError: an unknown ``grouping``.
    """
    if grouping not in GROUPING:
        raise ValueError(f"prefill grouping must be one of {GROUPING}, got {grouping!r}")
    if grouping == "off":
        return None
    order = sorted(range(len(lengths)), key=lambda b: (-lengths[b], b))
    groups: list[list[int]] = []
    while order:
        top = lengths[order[0]]
        take = [b for b in order if 2 * lengths[b] > top]
        groups.append(sorted(take))
        order = [b for b in order if 2 * lengths[b] <= top]
    if grouping == "always":
        return groups
    padded = len(lengths) * max(lengths)
    grouped = sum(len(g) * max(lengths[b] for b in g) for g in groups)
    return groups if len(groups) > 1 and padded >= GROUP_GAIN * grouped else None


def _ids_and_mask(state, rows: Sequence[Sequence[int]], lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded int64 ``input_ids`` [n, S] and mask [n, S] (ones over each row's length)."""
    S = int(lens.max())
    ids = np.full((len(rows), S), state.runner.model.config.pad_token_id, np.int64)
    for b, row in enumerate(rows):
        ids[b, : len(row)] = row
    return ids, (np.arange(S)[None, :] < lens[:, None]).astype(np.int64)


def _last_index(lens: np.ndarray) -> np.ndarray:
    """int64 [n]: row b's flat position ``b * S + length_b - 1`` in the [n * S] positions."""
    return np.arange(len(lens), dtype=np.int64) * int(lens.max()) + lens.astype(np.int64) - 1


def _binding(state, layers: list, ids: np.ndarray, mask: np.ndarray, last: np.ndarray | None):
    """A prefill IO binding over the runner's plan: ``layers`` (K, V) bound as past and
    present, the prompt ids and mask uploaded, and :data:`LAST_INDEX` when ``last`` is given.
    Its own binding, so the decode binding never sees the prefill inputs."""
    runner = state.runner
    p, cfg = runner.provider, runner.model.config
    binding = p.io_binding(runner.plan)
    for i, (k, v) in enumerate(layers):
        binding.bind_input(cfg.past_key % i, k)
        binding.bind_input(cfg.past_value % i, v)
        binding.bind_output(cfg.present_key % i, k)
        binding.bind_output(cfg.present_value % i, v)
    binding.bind_input("input_ids", p.upload(ids))
    binding.bind_input("attention_mask", p.upload(mask))
    if last is not None:
        binding.bind_input(LAST_INDEX, p.upload(last))
    return binding


def _check_in_place(state, outs: dict, buffer: Any) -> None:
    from core.plugins import ProviderError

    cfg = state.runner.model.config
    present = outs.get(cfg.present_key % 0)
    if present is not None and present is not buffer:
        raise ProviderError(
            f"provider {state.runner.provider.name!r} returned a new present KV tensor; it must write the shared "
            "past/present buffer in place (past_present_share_buffer, docs/ops.md 1.3 step 2)")


def run_prompts(state, input_ids: Sequence[Sequence[int]], all_logits: bool = False,
                grouping: str = "auto") -> tuple[Any, Any]:
    """Run the prompts into ``state``'s KV cache (module docstring).

    Args:
        state: a :class:`~core.runtime.state.DecodeState` of ``len(input_ids)`` rows, its
            lengths reset (``begin_request``) and room reserved for the longest prompt.
        input_ids: one token-id list per row (validated).
        all_logits: keep every position's logits (the padded run without the gather).
        grouping: :func:`plan_groups`'s ``grouping``.

    Returns:
        (logits, positions): logits ``[B, S, V]`` with positions ``length_b - 1``, or
        ``[B, 1, V]`` with positions 0, as device tensors for ``device_argmax``.

    Raises:
        core.plugins.ProviderError: the provider returned a new present KV tensor instead of
            writing the shared past/present buffer in place.
    """
    p = state.runner.provider
    lens = np.array([len(r) for r in input_ids], np.int64)
    last = not all_logits and state.runner.plan.last_position_steps is not None
    # scratch KV is outside the elastic device budget's accounting: no groups under one
    groups = plan_groups(lens.tolist(), grouping) if last and state.runner.device_budget is None else None
    counters = state.counters
    if groups is None:
        ids, mask = _ids_and_mask(state, input_ids, lens)
        binding = _binding(state, state.kv.layers, ids, mask, _last_index(lens) if last else None)
        outs = binding.run()
        _check_in_place(state, outs, state.kv.layers[0][0])
        counters.prefill_positions += ids.size
        counters.prefill_runs += 1
        if last:
            return outs["logits"], state.positions
        return outs["logits"], p.upload((lens - 1).astype(np.int32))
    logits = None
    for rows in groups:
        part, positions = _run_group(state, [input_ids[b] for b in rows], lens[rows], rows)
        if logits is None:
            logits = state.prompt_logits_buffer((state.batch, 1, part.shape[-1]), part.dtype)
        row_bytes = part.nbytes // len(rows)
        p.copy_bytes(logits, part, [(j * row_bytes, b * row_bytes, row_bytes) for j, b in enumerate(rows)])
        counters.prefill_positions += positions
        counters.prefill_runs += 1
    return logits, state.positions


def run_chunk(state, ids: Sequence[int], start: int) -> tuple[Any, Any]:
    """Run prompt positions ``[start, start + len(ids))`` of the one row of ``state`` (a
    decode state, or a view of one row of it, whose KV already holds positions ``[0, start)``)
    into its KV cache: one chunk of a chunked prefill.

    The plan runs ``input_ids [1, S]`` against a mask of ones ``[1, start + S]``:
    GroupQueryAttention's first prompt when ``start`` is 0, else a subsequent prompt at B = 1
    (docs/ops.md 1.4: past ``start``, total ``start + S``), the new K/V written in place at
    ``[start, start + S)``. Query position p reads keys ``[0, p]``, the keys a decode step at p
    reads, so where the provider's prompt attention walks the keys in the decode step's order
    (cpu_reference; cuda's split-KV chunks of 64 absolute positions) the chunk's bits are those
    of the unchunked prompt.

    Returns:
        (logits, positions): the logits of the chunk's last position ``[1, 1, V]`` and the
        positions ``device_argmax`` reads, as device tensors (the whole chunk's logits
        ``[1, S, V]`` with positions ``S - 1`` on a plan without a last-position program).

    Raises:
        core.plugins.ProviderError: the provider returned a new present KV tensor.
    """
    p = state.runner.provider
    n = len(ids)
    last = state.runner.plan.last_position_steps is not None
    binding = _binding(state, state.kv.layers, np.asarray(ids, np.int64)[None, :],
                       np.ones((1, start + n), np.int64), np.array([n - 1], np.int64) if last else None)
    outs = binding.run()
    _check_in_place(state, outs, state.kv.layers[0][0])
    state.counters.prefill_positions += n
    state.counters.prefill_runs += 1
    return outs["logits"], p.upload(np.array([0 if last else n - 1], np.int32))


def _run_group(state, rows_ids: list, lens: np.ndarray, rows: list[int]) -> tuple[Any, int]:
    """Run one length group in scratch KV buffers of its own batch and length, copy its live
    KV rows into ``state``'s cache at rows ``rows``; returns (its logits [n, 1, V], positions
    computed)."""
    p = state.runner.provider
    ids, mask = _ids_and_mask(state, rows_ids, lens)
    main = state.kv.geometry
    full = kvgeo.KVGeometry(main.layout, len(rows), main.kv_heads, ids.shape[1], main.head_size, main.itemsize)
    scratch = [ring.layer_geometry(full, w) for w in state.kv.windows]
    layers = [tuple(p.allocate(g.shape, state.kv.dtype) for _ in range(2)) for g in scratch]
    outs = _binding(state, layers, ids, mask, _last_index(lens)).run()
    _check_in_place(state, outs, layers[0][0])
    moves = [(j, b, int(n)) for j, (b, n) in enumerate(zip(rows, lens))]
    for (k, v), (dk, dv), w, src, dst in zip(layers, state.kv.layers, state.kv.windows, scratch,
                                             state.kv.layer_geometries):
        copies = ring.row_copies(src, dst, moves) if w else kvgeo.row_copies(src, dst, moves)
        p.copy_bytes(dk, k, copies)
        p.copy_bytes(dv, v, copies)
    return outs["logits"], int(ids.size)
