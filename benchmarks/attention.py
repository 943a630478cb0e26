"""GPU time of one GroupQueryAttention decode step (S = 1) on the cuda provider, per context.

A one-node ONNX model (packed QKV, rotary, the shared KV buffer) runs through core.executor.Plan
on the cuda provider; 20 launches are captured into one CUDA graph and replayed, timed with CUDA
events, so the number is the kernel's GPU time without host launch cost. Rows of one batch share
the context. Default shapes: SmolLM2-135M (9 query heads, 3 KV heads, head size 64).

    python benchmarks/attention.py --contexts 32,1024,4096 --batches 1,8 [--heads 9,3,64] [--prefill] [--json F]

Runs on any checkout whose Plan has the same constructor (so a before/after pair is one command
with PYTHONPATH pointing at the other tree).
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import onnx
from onnx import helper

REPS = 20


def _model(b: int, nq: int, nkv: int, h: int, cap: int, dtype, s: int = 1) -> onnx.ModelProto:
    t = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    width = (nq + 2 * nkv) * h
    inputs = [helper.make_tensor_value_info("query", t, [b, s, width]),
              helper.make_tensor_value_info("past_key", t, [b, nkv, cap, h]),
              helper.make_tensor_value_info("past_value", t, [b, nkv, cap, h]),
              helper.make_tensor_value_info("seqlens_k", onnx.TensorProto.INT32, [b]),
              helper.make_tensor_value_info("total_sequence_length", onnx.TensorProto.INT32, [])]
    outputs = [helper.make_tensor_value_info(n, t, None) for n in ("y", "present_key", "present_value")]
    angles = np.arange(cap)[:, None] / (10000.0 ** (np.arange(0, h, 2) / h))[None, :]
    inits = [onnx.numpy_helper.from_array(np.cos(angles).astype(dtype), "cos_cache"),
             onnx.numpy_helper.from_array(np.sin(angles).astype(dtype), "sin_cache")]
    node = helper.make_node("GroupQueryAttention",
                            ["query", "", "", "past_key", "past_value", "seqlens_k", "total_sequence_length",
                             "cos_cache", "sin_cache"], ["y", "present_key", "present_value"],
                            domain="com.microsoft", num_heads=nq, kv_num_heads=nkv, do_rotary=1,
                            scale=h ** -0.5)
    graph = helper.make_graph([node], "gqa", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                   helper.make_opsetid("com.microsoft", 1)])


def time_decode(provider, b: int, nq: int, nkv: int, h: int, context: int, dtype=np.float16,
                prefill: bool = False) -> float:
    """Microseconds of GPU time per decode launch at ``context`` positions per row (with
    ``prefill``: per first-prompt launch of ``context`` tokens per row, KV write included)."""
    import cupy

    from core.executor import Plan

    cap = -(-(context + 1) // 64) * 64
    s = context if prefill else 1
    model = _model(b, nq, nkv, h, cap, dtype, s)
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
    plan = Plan(model.graph, inits, provider)
    rng = np.random.default_rng(0)
    kv = rng.standard_normal((b, nkv, cap, h)).astype(dtype)
    feeds = {"query": provider.upload(rng.standard_normal((b, s, (nq + 2 * nkv) * h)).astype(dtype)),
             "past_key": provider.upload(kv), "past_value": provider.upload(kv.copy()),
             "seqlens_k": provider.upload(np.full(b, context - 1, np.int32)),
             "total_sequence_length": np.array(context, np.int32)}
    plan.run(feeds)
    plan.set_frozen(True)
    provider.begin_capture()
    for _ in range(REPS):
        plan.run(feeds)
    graph = provider.end_capture()
    plan.set_frozen(False)
    provider.replay(graph)
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    best = float("inf")
    for _ in range(5):
        start.record()
        provider.replay(graph)
        stop.record()
        stop.synchronize()
        best = min(best, cupy.cuda.get_elapsed_time(start, stop) * 1e3 / REPS)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="32,1024,4096")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--heads", default="9,3,64", help="query heads, KV heads, head size")
    ap.add_argument("--prefill", action="store_true", help="time a first prompt of `context` tokens instead")
    ap.add_argument("--json", dest="json_out")
    args = ap.parse_args()
    from providers.cuda.provider import CudaProvider

    provider = CudaProvider()
    nq, nkv, h = (int(x) for x in args.heads.split(","))
    rows = []
    for b in (int(x) for x in args.batches.split(",")):
        for ctx in (int(x) for x in args.contexts.split(",")):
            us = time_decode(provider, b, nq, nkv, h, ctx, prefill=args.prefill)
            rows.append({"batch": b, "context": ctx, "us": us, "prefill": args.prefill})
            what = "prefill" if args.prefill else "decode"
            print(f"batch {b:4d} context {ctx:6d}: {us:8.2f} us per GQA {what} launch")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
