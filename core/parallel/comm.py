"""A host communicator for simulated ranks: all-reduce and the cross-rank argmax over pipes.

The ranks form a star around rank 0 (one duplex :func:`multiprocessing.Pipe` per other
rank). An all-reduce sends every partial to rank 0, which sums them in rank order
(``((x_0 + x_1) + x_2) + ...``, fp32 for fp16 tensors, one rounding at the end) and sends the
one result back, so every rank holds the same bits and the bits are the same run to run.
Every receive waits at most ``timeout`` seconds; a peer that is gone (the pipe closed) or
silent past it is a :class:`CommError`. No rank-to-rank call ever waits forever.
"""

from __future__ import annotations

from multiprocessing.connection import Connection

import numpy as np


class CommError(RuntimeError):
    """A peer rank died, closed its pipe, or sent nothing within the timeout."""


class HostCommunicator:
    """Rank ``rank`` of ``size`` on pipes (module docstring).

    Args:
        rank, size: this rank and the rank count R.
        peers: rank 0: {r: connection to rank r} for r in 1..R-1; rank r > 0: {0: connection
            to rank 0}.
        timeout: seconds a receive waits before :class:`CommError`.

    Attributes:
        calls: all-reduce calls made; ``bytes``: bytes this rank contributed to them.
    """

    def __init__(self, rank: int, size: int, peers: dict[int, Connection], timeout: float):
        self.rank, self.size, self.peers, self.timeout = rank, size, peers, float(timeout)
        self.calls = 0
        self.bytes = 0
        self.argmax_calls = 0

    def _recv(self, peer: int) -> bytes:
        conn = self.peers[peer]
        try:
            if not conn.poll(self.timeout):
                raise CommError(f"rank {self.rank}: rank {peer} sent nothing for {self.timeout:g} s")
            return conn.recv_bytes()
        except (EOFError, OSError) as exc:
            raise CommError(f"rank {self.rank}: rank {peer} is gone ({type(exc).__name__})") from None

    def _send(self, peer: int, data: bytes) -> None:
        try:
            self.peers[peer].send_bytes(data)
        except (EOFError, OSError) as exc:
            raise CommError(f"rank {self.rank}: rank {peer} is gone ({type(exc).__name__})") from None

    def _gather_broadcast(self, mine: bytes, combine) -> bytes:
        """Rank 0 receives every rank's bytes in rank order, combines and sends the result
        back; the others send theirs and receive it."""
        if self.size == 1:
            return combine([mine])
        if self.rank == 0:
            parts = [mine] + [self._recv(r) for r in range(1, self.size)]
            out = combine(parts)
            for r in range(1, self.size):
                self._send(r, out)
            return out
        self._send(0, mine)
        return self._recv(0)

    def all_reduce(self, x: np.ndarray) -> np.ndarray:
        """The elementwise sum of ``x`` over every rank (same shape and dtype on each; fp32
        accumulation for fp16), in rank order; a new array on every rank.

        Raises:
            CommError: a peer is gone or silent past the timeout.
        """
        x = np.ascontiguousarray(x)
        shape, dtype = x.shape, x.dtype
        work = np.float32 if dtype == np.float16 else dtype

        def combine(parts: list[bytes]) -> bytes:
            acc = np.frombuffer(parts[0], dtype).astype(work)
            for part in parts[1:]:
                acc = acc + np.frombuffer(part, dtype).astype(work, copy=False)
            return acc.astype(dtype, copy=False).tobytes()

        self.calls += 1
        self.bytes += x.nbytes
        return np.frombuffer(self._gather_broadcast(x.tobytes(), combine), dtype).reshape(shape).copy()

    def argmax(self, values: np.ndarray, tokens: np.ndarray, bad: np.ndarray) -> np.ndarray:
        """The argmax over every rank's vocab shard, per row.

        Args:
            values: fp32 ``[B]``: each row's maximum over this rank's shard.
            tokens: int64 ``[B]``: its global token id (the lowest in the shard on ties).
            bad: bool ``[B]``: the row's shard held NaN or infinity.

        Returns:
            int32 ``[B, 2]`` ``[token, error]``: the largest value, the lowest token id on ties
            (shards hold ascending id ranges, so the first rank with the maximum wins); a row
            bad on any rank is ``[-1, 1]`` (docs/cases.md 12).

        Raises:
            CommError: a peer is gone or silent past the timeout.
        """
        b = len(values)
        rec = np.dtype([("v", np.float32), ("t", np.int64), ("bad", np.bool_)])
        mine = np.empty(b, rec)
        mine["v"], mine["t"], mine["bad"] = values, tokens, bad

        def combine(parts: list[bytes]) -> bytes:
            rows = [np.frombuffer(p, rec) for p in parts]
            best_v, best_t = rows[0]["v"].copy(), rows[0]["t"].copy()
            any_bad = rows[0]["bad"].copy()
            for r in rows[1:]:
                better = r["v"] > best_v  # strict: a tie keeps the lower rank's (lower) id
                best_v = np.where(better, r["v"], best_v)
                best_t = np.where(better, r["t"], best_t)
                any_bad |= r["bad"]
            out = np.empty((b, 2), np.int32)
            out[:, 0] = np.where(any_bad, -1, best_t)
            out[:, 1] = any_bad
            return out.tobytes()

        self.argmax_calls += 1
        return np.frombuffer(self._gather_broadcast(mine.tobytes(), combine), np.int32).reshape(b, 2).copy()

    def close(self) -> None:
        """Close every pipe end this rank holds."""
        for conn in self.peers.values():
            conn.close()
