"""Loading under a budget on cpu_reference: the placer keeps the device within the budget from
the first byte (only resident weights are ever uploaded), streamed weights go once to staged
host memory, the embedding is read in place from host memory, the tokens are bitwise those of
the resident run, and ``lockstep plan`` gives the same plan from the header alone.

cpu_reference's "device" is host memory, so its ``uploaded_bytes`` counts what a device would
have received; the GPU suite checks the driver's figure (tests/cuda/test_cuda_load_budget.py).
"""

import json
import os

import numpy as np
import pytest

from core import cli
from core.generation.loop import decode
from core.models.model import load_model
from core.plan import plan_model
from core.runtime import residency, streaming
from core.runtime.residency import BudgetError
from core.runtime.runner import Runner
from core.session import Session
from core.testing.tiny_model import TinyConfig, make_tiny_model
from providers.cpu_reference.provider import CpuReferenceProvider

ROWS = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14], [3], [4, 4, 4, 4], [7, 8], [9], [1, 2, 3]]


@pytest.fixture(autouse=True)
def small_tensors_stream(monkeypatch):
    """The tiny model's matrices are a few KiB: let everything but norms and biases stream."""
    monkeypatch.setattr(residency, "SMALL_BYTES", 512)


@pytest.fixture(scope="module", params=["fp32", "int4", "untied"])
def model_dir(request, tmp_path_factory):
    """fp32 (the embedding is the lm_head's weight, read by a column gather: resident), int4 (the
    table folds from the lm_head's codes into its own copy: mapped) and untied (a table of its
    own: mapped)."""
    config = TinyConfig(layers=4, vocab=128, context=128, tied=request.param != "untied")
    return make_tiny_model(tmp_path_factory.mktemp(f"tiny-{request.param}"),
                           quant="int4" if request.param == "int4" else None, config=config, external=True)


def tokens_and_logits(runner, rows, steps=8):
    s = Session(runner, batch=len(rows), capacity=64)
    logits = []
    t = decode(s, rows, steps, observer=lambda *_: logits.append(s.last_logits()))
    return t.tokens, np.stack(logits)


def half_budget(model_dir) -> int:
    weights = residency.weights_of(Runner(model_dir, CpuReferenceProvider()).plan)
    return residency.budget_for(weights, 0.5, slots=2, mappable=True)


def test_external_data_loads_as_memory_maps_equal_to_inline_data(model_dir, tmp_path):
    inline = load_model(make_tiny_model(tmp_path, quant="int4" if "int4" in model_dir.name else None,
                                        config=TinyConfig(layers=4, vocab=128, context=128,
                                                          tied="untied" not in model_dir.name)))
    mapped = load_model(model_dir)
    assert inline.initializers.keys() == mapped.initializers.keys()
    for name, a in mapped.initializers.items():
        assert a.dtype == inline.initializers[name].dtype and np.array_equal(a, inline.initializers[name])
    big = max(mapped.initializers.values(), key=lambda a: a.nbytes)
    assert isinstance(big.base if big.base is not None else big, np.memmap) or isinstance(big, np.memmap)


def test_load_uploads_only_what_stays_resident_and_decodes_bitwise(model_dir):
    resident = Runner(model_dir, CpuReferenceProvider())
    budget = half_budget(model_dir)
    prov = CpuReferenceProvider()
    runner = Runner(model_dir, prov, weight_budget=budget, staging_slots=2)
    placer, r = runner.placer, runner.residency
    assert placer is not None and r.streams
    # the device never held a streamed weight: every upload of the load is a resident weight
    assert prov.uploaded_bytes == runner.weight_upload_bytes <= budget - r.staging_bytes
    assert placer.peak_bytes <= budget
    staged_at_load = {n for n, kind in placer.decisions.items() if kind == "staged"}
    assert staged_at_load == set(r.streamed), "the load staged other weights than the plan streams"
    assert runner.weight_bytes + r.staging_bytes <= budget
    # an embedding only its lookup reads is read in place from host memory, neither resident
    # nor streamed (the fp32 one is the lm_head's weight: resident)
    mapped = [n for n in r.mapped if streaming.mapped(runner.plan, n)]
    assert len(mapped) == len(r.mapped) == (0 if "fp32" in model_dir.name else 1)
    for name in mapped:
        assert placer.decisions[name] == "mapped" and r.weight_bytes_mapped > 0 and name not in r.streamed
        assert runner.plan.constants[name] is runner.plan.staged_weights[name]
    for batch in (1, 8):
        want, got = tokens_and_logits(resident, ROWS[:batch]), tokens_and_logits(runner, ROWS[:batch])
        assert np.array_equal(want[0], got[0]) and np.array_equal(want[1], got[1])


def test_a_budget_one_byte_below_the_smallest_is_refused_with_that_number(model_dir):
    with pytest.raises(BudgetError) as info:
        Runner(model_dir, CpuReferenceProvider(), weight_budget=1)
    smallest = int(str(info.value).rsplit("is ", 1)[1].split()[0].replace(",", ""))
    prov = CpuReferenceProvider()
    runner = Runner(model_dir, prov, weight_budget=smallest)
    assert runner.residency.streams
    assert prov.uploaded_bytes + runner.residency.staging_bytes <= smallest
    with pytest.raises(BudgetError, match=f"smallest working budget is {smallest:,} bytes"):
        Runner(model_dir, CpuReferenceProvider(), weight_budget=smallest - 1)


def test_a_device_budget_holds_at_load_too(model_dir):
    budget = half_budget(model_dir)
    prov = CpuReferenceProvider()
    runner = Runner(model_dir, prov, device_budget=budget)
    assert runner.placer is not None and runner.residency.streams
    assert prov.uploaded_bytes + runner.residency.staging_bytes <= budget


def test_plan_reads_no_weight_and_matches_the_loaded_plan(model_dir, tmp_path):
    budget = half_budget(model_dir)
    runner = Runner(model_dir, CpuReferenceProvider(), weight_budget=budget, staging_slots=2)
    # the same folder with a data file of zeros (sparse: never written): the plan only reads sizes
    hollow = tmp_path / "hollow"
    hollow.mkdir()
    for f in model_dir.iterdir():
        if f.name != "model.onnx.data":
            (hollow / f.name).write_bytes(f.read_bytes())
    with open(hollow / "model.onnx.data", "wb") as out:
        out.truncate(os.path.getsize(model_dir / "model.onnx.data"))
    rows = [plan_model(folder, [1], 64, CpuReferenceProvider(), weight_budget=budget, slots=2)[0]
            for folder in (model_dir, hollow)]
    assert rows[0].row() == rows[1].row()
    p = rows[0].residency
    assert p.streamed == runner.residency.streamed and p.mapped == runner.residency.mapped
    assert p.weight_bytes_streamed_per_step == runner.residency.weight_bytes_streamed_per_step


def test_plan_gives_the_copy_floor_and_a_row_per_batch(model_dir, capsys):
    budget = half_budget(model_dir)
    work = Runner(model_dir, CpuReferenceProvider()).workspace_estimate(8, 64, (8, 64))  # a prefill of 8 x 64 too
    device = budget + 2 * 8 * 4 * 2 * 16 * 64 * 4 + work  # room for 8 rows of KV at 64 tokens and their workspace
    code = cli.main(["plan", str(model_dir), "--provider", "cpu_reference", "--device-budget", str(device),
                     "--batch", "1,8,64", "--context", "64", "--h2d-gbps", "10", "--json"])
    assert code == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["batch"] for r in rows] == [1, 8, 64]
    one, eight, many = rows
    assert one["weight_bytes_streamed_per_step"] <= eight["weight_bytes_streamed_per_step"]
    assert eight["copy_floor_ms"] == pytest.approx(eight["weight_bytes_streamed_per_step"] / 10e9 * 1e3)
    assert eight["expected_tok_s"] == pytest.approx(8 / (eight["copy_floor_ms"] / 1e3))
    assert "error" in many and "KV" in many["error"]


def test_a_model_that_does_not_fit_streams_on_its_own_and_says_so_on_one_line(model_dir, caplog):
    from core.runtime import runner as runner_module

    budget = half_budget(model_dir)

    class SmallDevice(CpuReferenceProvider):
        def free_device_bytes(self):
            return int(budget / runner_module.AUTO_SHARE)

        def host_to_device_bandwidth(self):
            return 10e9

    with caplog.at_level("WARNING", logger="lockstep"):
        runner = Runner(model_dir, SmallDevice())
    assert runner.auto_budget and runner.placer is not None and runner.residency.streams
    assert runner.residency.budget <= budget
    lines = [r.getMessage() for r in caplog.records if "do not fit" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0]
    rate = 1 / (runner.residency.weight_bytes_streamed_per_step / 10e9)
    assert f"about {rate:.1f} tok/s at batch 1" in lines[0]
    # a model that fits: nothing streams, nothing is said
    caplog.clear()
    with caplog.at_level("WARNING", logger="lockstep"):
        fits = Runner(model_dir, CpuReferenceProvider())
    assert not fits.auto_budget and fits.placer is None and not caplog.records
