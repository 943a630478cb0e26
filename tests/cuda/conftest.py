"""GPU-only tests. Each module starts with ``gpu_or_skip()``-style guards (see
``tests/cuda/_gpu.py``), so without CuPy or a visible GPU they are reported as skipped."""

import os
from pathlib import Path

import pytest

VARIANTS = {"fp32": ("float32", None), "fp16": ("float16", None), "int4": ("float16", "int4")}


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/cuda/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.cuda)


@pytest.fixture(scope="session")
def gpu():
    from providers.cuda.provider import CudaProvider

    return CudaProvider()


def _models():
    out = [pytest.param(("tiny", v), id=f"tiny-{v}") for v in VARIANTS]
    root = os.environ.get("LOCKSTEP_CUDA_MODELS")
    if root:
        out += [pytest.param(("smollm2", v), id=f"smollm2-{v}") for v in VARIANTS
                if (Path(root) / v / "model.onnx").exists()]
    return out


@pytest.fixture(scope="module", params=_models())
def model_dir(request, tmp_path_factory):
    """Model folders: tiny builder-pattern models made here (fp32, fp16, int4), plus the
    SmolLM2-shaped ones under $LOCKSTEP_CUDA_MODELS (folders fp32, fp16, int4 made by
    benchmarks/build_test_model.py) when that variable is set."""
    from core.testing.tiny_model import make_tiny_model

    kind, variant = request.param
    if kind == "smollm2":
        return Path(os.environ["LOCKSTEP_CUDA_MODELS"]) / variant
    dtype, quant = VARIANTS[variant]
    return make_tiny_model(tmp_path_factory.mktemp(variant), dtype=dtype, quant=quant)


#: precision -> the builder target of a tiny gpt-oss folder (fp16 CUDA build: MoE; int4 CPU build: QMoE)
GPT_OSS_TARGETS = {"fp16": "cuda", "int4": "cpu"}


@pytest.fixture(scope="session")
def gpt_oss(tmp_path_factory):
    """precision -> the loaded tiny gpt-oss model (core.testing.moe_families), built once a run."""
    from core.models.model import load_model
    from core.testing.families import prepared_family

    root = tmp_path_factory.mktemp("gpt-oss")
    built: dict[str, object] = {}

    def get(precision: str):
        if precision not in built:
            built[precision] = load_model(prepared_family("gpt-oss", root / precision, precision,
                                                          GPT_OSS_TARGETS[precision]))
        return built[precision]

    return get
