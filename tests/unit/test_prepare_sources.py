"""core.prepare for path sources (no real build here: tests/models/test_families.py builds with
the real builder), the shared cache under two processes, the unsupported-node error, the If of
constant branches and the GELU ops."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from core.cli import main
from core.executor import Plan, UnsupportedOpError
from core.models.prepare import RECIPE, STAMP, PrepareError, Variant, source_digest, source_kind
from providers.cpu_reference.provider import CpuReferenceProvider

REPO = Path(__file__).resolve().parents[2]


def hf_folder(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (path / "model.safetensors").write_bytes(b"weights")
    (path / "tokenizer.json").write_text("{}")
    return path


def test_unknown_model_name_lists_the_known_models(capsys):
    assert main(["prepare", "no-such-model"]) == 2
    err = capsys.readouterr().err
    assert "unknown model 'no-such-model'" in err and "smollm2-135m" in err and err.count("\n") == 1


def test_prepare_list_shows_models_and_variants_and_builds_nothing(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("LOCKSTEP_CACHE", str(tmp_path))
    assert main(["prepare", "--list"]) == 0
    out = capsys.readouterr().out
    assert "smollm2-135m" in out and "fp16/cuda" in out and "not offered" in out
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("precision,target", [("fp16", "cpu"), ("fp32", "cuda")])
def test_variants_that_do_not_run_are_refused_with_why(precision, target):
    with pytest.raises(PrepareError, match="not offered: the builder's"):
        Variant("smollm2-135m", precision, target)


def test_source_kinds_and_incomplete_folders(tmp_path):
    assert source_kind(hf_folder(tmp_path / "hf")) == "hf"
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    assert source_kind(tmp_path / "m.gguf") == "gguf"
    (tmp_path / "empty").mkdir()
    with pytest.raises(PrepareError, match="neither config.json"):
        source_kind(tmp_path / "empty")
    with pytest.raises(PrepareError, match="no such file or folder"):
        source_kind(tmp_path / "absent" / "x")


def test_content_hash_follows_the_files_not_the_path(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCKSTEP_CACHE", str(tmp_path / "cache"))
    a = hf_folder(tmp_path / "a")
    b = hf_folder(tmp_path / "b")
    (a / "README.md").write_text("not hashed")
    assert source_digest(a) == source_digest(b)
    (b / "model.safetensors").write_bytes(b"other weights")
    assert source_digest(a) != source_digest(b)


FAKE_BUILD = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    import core.models.prepare as p

    def fake(hf, tmp, variant, root, progress):
        # a slow builder that records each build; writes what a builder folder needs
        with open(os.environ["BUILD_LOG"], "a") as log:
            log.write(f"{os.getpid()}\\n")
        time.sleep(1.5)
        (tmp / "model.onnx").write_bytes(b"onnx")
        (tmp / "genai_config.json").write_text("{}")

    p._run_builder = fake
    p._check_tools = lambda gguf: None
    print(p.prepare(p.Variant(sys.argv[1], "fp32", "cpu")))
""")


def test_two_processes_on_an_empty_cache_build_once_and_share_the_folder(tmp_path):
    hf = hf_folder(tmp_path / "hf")
    log = tmp_path / "builds.log"
    env = {"LOCKSTEP_CACHE": str(tmp_path / "cache"), "BUILD_LOG": str(log), "PYTHONPATH": str(REPO),
           "PATH": "/usr/bin:/bin"}
    procs = [subprocess.Popen([sys.executable, "-c", FAKE_BUILD, str(hf)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    results = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results
    folders = {out.strip() for out, _ in results}
    assert len(folders) == 1
    folder = Path(folders.pop())
    assert (folder / "model.onnx").read_bytes() == b"onnx" and (folder / "genai_config.json").exists()
    assert len(log.read_text().split()) == 1, "the second process must reuse the first one's build"
    leftovers = [p.name for p in folder.parent.iterdir() if p != folder]
    assert leftovers == [], "no temporary folder is left behind"


def _fake_builds(monkeypatch, tmp_path):
    """prepare() in this process with a builder that records its calls and writes a folder."""
    import core.models.prepare as p

    monkeypatch.setenv("LOCKSTEP_CACHE", str(tmp_path / "cache"))
    builds = []

    def fake(hf, tmp, variant, root, progress):
        builds.append(variant)
        (tmp / "model.onnx").write_bytes(b"onnx")
        (tmp / "genai_config.json").write_text("{}")

    monkeypatch.setattr(p, "_run_builder", fake)
    monkeypatch.setattr(p, "_check_tools", lambda gguf: None)
    return p, builds


def test_a_cached_folder_of_an_earlier_recipe_is_rebuilt_and_a_current_one_reused(tmp_path, monkeypatch):
    p, builds = _fake_builds(monkeypatch, tmp_path)
    variant = Variant(str(hf_folder(tmp_path / "hf")), "fp32", "cpu")
    lines: list[str] = []
    out = p.prepare(variant, progress=lines.append)
    stamp = json.loads((out / STAMP).read_text())
    assert len(builds) == 1 and stamp["recipe"] == RECIPE and (stamp["precision"], stamp["target"]) == ("fp32", "cpu")
    assert p.prepare(variant, progress=lines.append) == out and len(builds) == 1  # current: reused
    # an earlier recipe, a stamp that is not JSON, or a folder from before the stamp
    for old in (json.dumps({"recipe": RECIPE - 1}), "{not json", None):
        if old is None:
            (out / STAMP).unlink()
        else:
            (out / STAMP).write_text(old)
        lines.clear()
        assert p.prepare(variant, progress=lines.append) == out
        assert any("earlier Lockstep recipe" in line for line in lines), lines
        assert json.loads((out / STAMP).read_text())["recipe"] == RECIPE
    assert len(builds) == 4


def test_an_output_folder_holding_a_model_is_reused_whatever_made_it(tmp_path, monkeypatch):
    p, builds = _fake_builds(monkeypatch, tmp_path)
    out = tmp_path / "mine"
    out.mkdir()
    (out / "model.onnx").write_bytes(b"user's")
    (out / "genai_config.json").write_text("{}")
    variant = Variant(str(hf_folder(tmp_path / "hf")), "fp32", "cpu")
    assert p.prepare(variant, output=out) == out and builds == []
    assert (out / "model.onnx").read_bytes() == b"user's" and not (out / STAMP).exists()


def _graph(nodes, inputs, outputs, inits=()):
    g = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)]).graph


def test_unsupported_error_lists_every_node_with_its_reason():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    nodes = [helper.make_node("NoSuchOp", ["x" if i == 0 else f"y{i - 1}"], [f"y{i}"], name=f"n{i}")
             for i in range(30)]
    nodes.append(helper.make_node("Gelu", ["y29"], ["z"], name="bad_gelu", approximate="erf"))
    graph = _graph(nodes, [x], [helper.make_tensor_value_info("z", TensorProto.FLOAT, [2])])
    with pytest.raises(UnsupportedOpError) as exc:
        Plan(graph, {}, CpuReferenceProvider())
    text = str(exc.value)
    assert "31 node(s) of 2 kind(s)" in text and "'n29'" in text and "'n0'" in text
    assert "no op module for ai.onnx.NoSuchOp" in text and "approximate='erf'" in text


def test_if_with_constant_branches_selects_by_a_host_condition():
    def branch(value):
        const = helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(value))
        return helper.make_graph([const], "b", [], [helper.make_tensor_value_info("c", TensorProto.FLOAT, [2])])

    n = helper.make_tensor_value_info("n", TensorProto.INT64, [])
    limit = numpy_helper.from_array(np.array(4, np.int64), "limit")
    nodes = [helper.make_node("Greater", ["n", "limit"], ["cond"], name="gt"),
             helper.make_node("If", ["cond"], ["picked"], name="if",
                              then_branch=branch(np.array([1.0, 2.0], np.float32)),
                              else_branch=branch(np.array([3.0, 4.0], np.float32))),
             helper.make_node("Add", ["picked", "picked"], ["out"], name="add")]
    graph = _graph(nodes, [n], [helper.make_tensor_value_info("out", TensorProto.FLOAT, [2])], [limit])
    plan = Plan(graph, {"limit": np.array(4, np.int64)}, CpuReferenceProvider())
    assert plan.kernels[1].__name__ == "select_branch"
    assert plan.run({"n": np.array(9, np.int64)})["out"].tolist() == [2.0, 4.0]
    assert plan.run({"n": np.array(4, np.int64)})["out"].tolist() == [6.0, 8.0]


def test_gelu_ops_follow_their_formulas():
    from core.protocol import KernelContext, NodeInfo
    from providers.cpu_reference.ops import fast_gelu, gelu, quick_gelu

    x = np.linspace(-6, 6, 97, dtype=np.float32)
    provider = CpuReferenceProvider()

    def call(module, attrs, *args):
        node = NodeInfo(name="n", op_type=module.OP_TYPE, domain=module.DOMAIN, attrs=attrs,
                        inputs=tuple(f"i{j}" for j in range(len(args))), outputs=("y",),
                        input_dtypes=(np.dtype(np.float32),) * len(args))
        return module.run(KernelContext(node, provider, "head_major"), *args)[0].astype(np.float64)

    xd = x.astype(np.float64)
    exact = 0.5 * xd * (1 + np.array([math.erf(v / math.sqrt(2)) for v in xd]))
    tanh = 0.5 * xd * (1 + np.tanh(math.sqrt(2 / math.pi) * (xd + 0.044715 * xd ** 3)))
    assert np.abs(call(gelu, {"approximate": "none"}, x) - exact).max() < 1e-5
    assert np.abs(call(gelu, {"approximate": "tanh"}, x) - tanh).max() < 1e-5
    bias = np.float32(0.5)
    shifted = xd + 0.5
    fast = 0.5 * shifted * (1 + np.tanh(math.sqrt(2 / math.pi) * (shifted + 0.044715 * shifted ** 3)))
    assert np.abs(call(fast_gelu, {}, x, np.full(97, bias)) - fast).max() < 1e-5
    assert np.abs(call(quick_gelu, {"alpha": 1.702}, x) - xd / (1 + np.exp(-1.702 * xd))).max() < 1e-5
    assert not gelu.supports(NodeInfo(name="n", op_type="Gelu", domain="", attrs={"approximate": "erf"},
                                      inputs=("x",), outputs=("y",), input_dtypes=(np.dtype(np.float32),)))


def test_a_build_removes_what_an_interrupted_build_left_and_writes_readable_folders(tmp_path):
    """An interrupted build (SIGTERM skips the cleanup) leaves ``<name>.tmp-*`` beside the
    cache folder; the next build, holding the folder's lock, removes it, and its own temporary
    folder (renamed into place when done) is 0755 like the rest of the cache."""
    from core.models.prepare import _new_tmp

    out = tmp_path / "models" / "m-fp32-cpu"
    out.parent.mkdir(parents=True)
    stale = out.parent / "m-fp32-cpu.tmp-dead"
    (stale / "half").mkdir(parents=True)
    other = out.parent / "other-fp32-cpu.tmp-x"
    other.mkdir()
    tmp = _new_tmp(out)
    assert not stale.exists() and other.exists() and tmp.is_dir()
    assert tmp.name.startswith("m-fp32-cpu.tmp-") and (tmp.stat().st_mode & 0o777) == 0o755


def test_builder_info_lines_are_thinned_but_kept_for_an_error(tmp_path, monkeypatch):
    """The int4 quantizer logs every node and the builder's progress bars redraw once per tensor
    (carriage returns): at most one such line a second reaches the progress callback, every other
    line does, and a failed build still reports the whole tail."""
    from core.models import prepare as p

    script = tmp_path / "fake_builder.py"
    script.write_text(
        "import sys\n"
        "print('Reading embedding layer')\n"
        "for i in range(500):\n"
        "    print(f'2026-12-02 04:20:46,591 onnxruntime.quantization.matmul_nbits_quantizer [INFO] - node {i}')\n"
        "for i in range(301):\n"
        "    print(f'\\rLoading weights: {i // 3:3d}%|####      | {i}/300 [00:01<00:01, 99.1it/s]', end='')\n"
        "print()\n"
        "print('Saving ONNX model')\n"
        "sys.exit(int(sys.argv[-1] == 'fail'))\n")
    seen: list[str] = []
    variant = p.Variant("smollm2-135m", "int4", "cpu")
    monkeypatch.setattr(p, "BUILDER_OPTIONS", ("ok",))
    monkeypatch.setattr(p, "BUILDER_COMMAND", (sys.executable, str(script)))
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(p.PrepareError):  # it wrote no model.onnx
        p._run_builder(tmp_path, out, variant, tmp_path, seen.append)
    info = [s for s in seen if "[INFO]" in s]
    bars = [s for s in seen if "Loading weights" in s]
    assert "builder: Reading embedding layer" in seen and "builder: Saving ONNX model" in seen
    assert 1 <= len(info) < 10 and 1 <= len(bars) < 10  # 500 and 301 written in well under 10 s
    monkeypatch.setattr(p, "BUILDER_OPTIONS", ("fail",))
    with pytest.raises(p.PrepareError, match="node 499"):
        p._run_builder(tmp_path, out, variant, tmp_path, None)


@pytest.mark.parametrize("where", ["output", "cache"])
def test_an_unwritable_output_or_cache_is_refused_before_any_build(tmp_path, monkeypatch, capsys, where):
    """A folder that cannot be created or written gets one line naming the setting, before the
    GGUF conversion or the builder (minutes of work) starts."""
    import core.models.prepare as prep

    started = []
    monkeypatch.setattr(prep, "_check_tools", lambda gguf: None)
    monkeypatch.setattr(prep, "_gguf_to_hf", lambda *args: started.append("convert"))
    monkeypatch.setattr(prep, "_run_builder", lambda *args: started.append("build"))
    afile = tmp_path / "afile"
    afile.write_text("not a folder")
    if where == "output":
        monkeypatch.setenv("LOCKSTEP_CACHE", str(tmp_path / "cache"))
        args, named = ["prepare", "--output", str(afile / "model")], "--output"
    else:
        monkeypatch.setenv("LOCKSTEP_CACHE", str(afile / "cache"))
        args, named = ["prepare"], "LOCKSTEP_CACHE"
    assert main(args) == 2
    err = capsys.readouterr().err
    assert named in err and "nothing was built" in err and err.count("error:") == 1
    assert not started
