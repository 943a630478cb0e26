"""Graph rewrites the core applies when the provider supports the fused op.

Each pass replaces a chain of nodes by one node of the ``lockstep`` domain whose semantics are
exactly the chain's, rounding included (so a fused run is bitwise the unfused one on the same
provider). A pass fires only where ``provider.supports(fused)`` is true and the intermediate
values have no other consumer and are not graph outputs.

- ``lockstep.SiluMul(x, up) = Mul(Mul(x, Sigmoid(x)), up)``: the SiLU-gated MLP the builder
  writes as Sigmoid + Mul + Mul (OPS.md 0, step 6); 3 nodes -> 1 per layer.
"""

from __future__ import annotations

from collections import defaultdict

from core.protocol import NodeInfo

FUSED_DOMAIN = "lockstep"


def _consumers(nodes: list[NodeInfo]) -> dict[str, list[int]]:
    out = defaultdict(list)
    for i, n in enumerate(nodes):
        for x in n.inputs:
            if x:
                out[x].append(i)
    return out


def fuse_silu_mul(nodes: list[NodeInfo], graph_outputs: set[str], supports) -> list[NodeInfo]:
    """Replace Sigmoid(x) -> Mul(x, s) -> Mul(g, up) chains by ``lockstep.SiluMul(x, up)``."""
    users = _consumers(nodes)
    replaced: dict[int, NodeInfo | None] = {}
    for i, sig in enumerate(nodes):
        if (sig.op_type, sig.domain) != ("Sigmoid", ""):
            continue
        x, s = sig.inputs[0], sig.outputs[0]
        if len(users[s]) != 1 or s in graph_outputs:
            continue
        j = users[s][0]
        gate = nodes[j]
        if (gate.op_type, gate.domain) != ("Mul", "") or sorted(gate.inputs) != sorted([x, s]):
            continue
        g = gate.outputs[0]
        if len(users[g]) != 1 or g in graph_outputs:
            continue
        k = users[g][0]
        mul = nodes[k]
        if (mul.op_type, mul.domain) != ("Mul", ""):
            continue
        up = mul.inputs[1] if mul.inputs[0] == g else mul.inputs[0]
        dtypes = (sig.input_dtypes[0] if sig.input_dtypes else None,
                  dict(zip(mul.inputs, mul.input_dtypes)).get(up) if mul.input_dtypes else None)
        fused = NodeInfo(name=f"{mul.name}/SiluMul", op_type="SiluMul", domain=FUSED_DOMAIN, attrs={},
                         inputs=(x, up), outputs=(mul.outputs[0],), input_dtypes=dtypes)
        if not supports(fused):
            continue
        replaced[i], replaced[j], replaced[k] = None, None, fused
    return [replaced.get(i, n) for i, n in enumerate(nodes) if replaced.get(i, n) is not None]


PASSES = (fuse_silu_mul,)


def apply(nodes: list[NodeInfo], graph_outputs: set[str], supports) -> list[NodeInfo]:
    """Run every pass of :data:`PASSES` in order."""
    for p in PASSES:
        nodes = p(nodes, graph_outputs, supports)
    return nodes
