"""The builder's int4 CUDA build of the MoE families: its QMoE experts in ONNX Runtime's CUDA
layout (core.qmoe_layout), read by cpu_reference through the repack.

The CUDA build writes its expert codes prepacked for ORT's CUTLASS fpA_intB GEMM, [E, K, N/2],
with no ``weights_prepacked`` attribute (0.18). Repacked, they are bitwise the CPU build's codes
of the same checkpoint, with the same scale values (fp16 there, fp32 in the CPU build), so the
dequantized experts are bitwise the CPU build's. The CUDA folder decodes on cpu_reference with
the bits of a copy whose codes are stored raw. (Its logits are not the CPU build's: fp16
activations, a router that flips at near-ties; teacher-forced they differed by up to 23% of the
logit spread, argmax agreeing on 82-90% of the steps.)

The tiny LFM2-MoE of core.testing.moe_families has an expert inter size of 32, which the
builder's CUDA packer refuses (``num_rows (32) is incompatible with column-interleave
tiling``: K must be a multiple of 64); it is built here with ``moe_intermediate_size=64``.
gpt-oss's tiny geometry (inter size 64) builds as it is.
"""

from __future__ import annotations

import shutil

import numpy as np
import onnx
import pytest

from core import qmoe_layout
from core.generation.loop import decode
from core.models.model import load_model
from core.session import Session
from core.testing.families import prepared_family

pytest.importorskip("onnxruntime_genai")
pytest.importorskip("transformers")

pytestmark = pytest.mark.model

STEPS = 12
CAPACITY = 48
PROMPTS = [[5, 17, 42, 99, 3], list(range(10, 21)), [200, 7, 7, 31, 64, 128, 9, 250, 1, 33, 77, 12, 6]]
#: family -> geometry overrides the builder's CUDA packer needs.
FAMILIES = {"gpt-oss": None, "lfm2-moe": {"moe_intermediate_size": 64}}


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """family -> {target: its int4 folder}, built on first use from one checkpoint per family."""
    root = tmp_path_factory.mktemp("qmoe-layout")
    made: dict[str, dict] = {}

    def get(family: str) -> dict:
        if family not in made:
            made[family] = {t: prepared_family(family, root / family / t, "int4", t, overrides=FAMILIES[family])
                            for t in ("cpu", "cuda")}
        return made[family]

    return get


def _qmoe_nodes(folder):
    graph = onnx.load(str(folder / "model.onnx")).graph
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in graph.initializer}
    return [(n, [inits.get(x) if x else None for x in n.input]) for n in graph.node if n.op_type == "QMoE"]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_cuda_builds_codes_repack_to_the_cpu_builds(builds, family):
    from providers.cpu_reference.ops.qmoe import dequantize

    folders = builds(family)
    cuda, cpu = _qmoe_nodes(folders["cuda"]), _qmoe_nodes(folders["cpu"])
    assert len(cuda) == len(cpu) == 2
    for (node, a), (_, b) in zip(cuda, cpu):
        attrs = {x.name: onnx.helper.get_attribute_value(x) for x in node.attribute}
        assert "weights_prepacked" not in attrs and a[2].shape != b[2].shape, "the CUDA layout, unannounced"
        fc1, fc2, _ = qmoe_layout.as_raw(attrs, a[2], a[3], a[5], a[6])
        assert np.array_equal(fc1, b[2]) and np.array_equal(fc2, b[5])
        for s_cuda, s_cpu in ((a[3], b[3]), (a[6], b[6])):
            assert np.array_equal(s_cuda.astype(np.float32), s_cpu.astype(np.float32))
        hidden = b[5].shape[1]
        assert np.array_equal(dequantize(fc1, a[3], None, hidden, 4, 32), dequantize(b[2], b[3], None, hidden, 4, 32))


def _run(folder, rows, force=None):
    model = load_model(folder)
    session = Session(model, "cpu_reference", batch=len(rows), capacity=CAPACITY)
    logits = []
    trace = decode(session, rows, STEPS, force=force,
                   observer=lambda *_: logits.append(np.asarray(session.last_logits(), np.float32)))
    return trace.tokens.T, np.stack(logits, 1)


def _raw_rewrite(folder, out):
    """A copy of ``folder`` whose QMoE codes are stored in the raw layout (weights_prepacked=0)."""
    shutil.copytree(folder, out)
    model = onnx.load(str(out / "model.onnx"))
    inits = {i.name: i for i in model.graph.initializer}
    for node in (n for n in model.graph.node if n.op_type == "QMoE"):
        attrs = {x.name: onnx.helper.get_attribute_value(x) for x in node.attribute}
        arrays = [onnx.numpy_helper.to_array(inits[x]) if x in inits else None for x in node.input]
        raw = qmoe_layout.as_raw(attrs, arrays[2], arrays[3], arrays[5], arrays[6])
        for index, codes in zip((2, 5), raw):
            inits[node.input[index]].CopyFrom(onnx.numpy_helper.from_array(codes, node.input[index]))
        node.attribute.append(onnx.helper.make_attribute("weights_prepacked", 0))
    onnx.save(model, str(out / "model.onnx"))
    return out


def _run(folder, rows):
    model = load_model(folder)
    session = Session(model, "cpu_reference", batch=len(rows), capacity=CAPACITY)
    logits = []
    trace = decode(session, rows, STEPS, observer=lambda *_: logits.append(np.asarray(session.last_logits())))
    return trace.tokens.T, np.stack(logits, 1)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_cuda_build_decodes_bitwise_as_its_raw_layout_copy(builds, tmp_path, family):
    """The CUDA folder loads on cpu_reference (no refusal) and its tokens and logits are the bits
    of the same folder with the codes stored raw: the layout is read, nothing else changes."""
    folder = builds(family)["cuda"]
    tokens, logits = _run(folder, PROMPTS)
    raw_tokens, raw_logits = _run(_raw_rewrite(folder, tmp_path / "raw"), PROMPTS)
    assert np.array_equal(tokens, raw_tokens) and np.array_equal(logits, raw_logits)
    assert len({int(t) for t in tokens.ravel()}) > 1
