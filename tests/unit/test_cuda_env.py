"""The cuda provider's environment switches (providers/cuda/env.py), without a GPU: the accepted
spellings, the defaults for unset and empty, and a clear error for anything else."""

import pytest

from core.plugins import ProviderError
from providers.cuda import env


@pytest.mark.parametrize("raw,expected", [("1", True), ("TRUE", True), (" yes ", True), ("On", True),
                                          ("0", False), ("false", False), ("No", False), ("off", False)])
def test_a_switch_takes_the_usual_spellings(monkeypatch, raw, expected):
    monkeypatch.setenv("LOCKSTEP_TEST_SWITCH", raw)
    assert env.flag("LOCKSTEP_TEST_SWITCH", not expected) is expected


@pytest.mark.parametrize("default", [False, True])
def test_unset_or_empty_is_the_default(monkeypatch, default):
    monkeypatch.delenv("LOCKSTEP_TEST_SWITCH", raising=False)
    assert env.flag("LOCKSTEP_TEST_SWITCH", default) is default
    monkeypatch.setenv("LOCKSTEP_TEST_SWITCH", "")
    assert env.flag("LOCKSTEP_TEST_SWITCH", default) is default


def test_anything_else_is_an_error_naming_the_variable(monkeypatch):
    monkeypatch.setenv("LOCKSTEP_CUDA_GEMM_WIDE", "2")
    with pytest.raises(ProviderError, match="LOCKSTEP_CUDA_GEMM_WIDE must be 1 or 0.*not '2'"):
        env.flag("LOCKSTEP_CUDA_GEMM_WIDE", False)


def test_a_choice_is_one_of_its_values(monkeypatch):
    monkeypatch.setenv("LOCKSTEP_CUDA_GEMM_SPLIT", "Off")
    assert env.choice("LOCKSTEP_CUDA_GEMM_SPLIT", "auto", ("auto", "off")) == "off"
    monkeypatch.setenv("LOCKSTEP_CUDA_GEMM_SPLIT", "")
    assert env.choice("LOCKSTEP_CUDA_GEMM_SPLIT", "auto", ("auto", "off")) == "auto"
    monkeypatch.setenv("LOCKSTEP_CUDA_GEMM_SPLIT", "never")
    with pytest.raises(ProviderError, match="'auto' or 'off', not 'never'"):
        env.choice("LOCKSTEP_CUDA_GEMM_SPLIT", "auto", ("auto", "off"))


def test_the_switches_read_through_it(monkeypatch):
    monkeypatch.setenv("LOCKSTEP_CUDA_ATTN_HINT", "off")
    assert env.switch("LOCKSTEP_CUDA_ATTN_HINT") is False
    monkeypatch.setenv("LOCKSTEP_CUDA_ATTN_HINT", "maybe")
    with pytest.raises(ProviderError, match="LOCKSTEP_CUDA_ATTN_HINT"):
        env.switch("LOCKSTEP_CUDA_ATTN_HINT")


@pytest.mark.parametrize("name", sorted(set(env.SWITCHES) - {"LOCKSTEP_CUDA_REPLAY"}))
def test_the_provider_names_a_bad_switch_before_anything_else(monkeypatch, name):
    """CudaProvider() refuses a bad value of any switch first: without CuPy (as here on CI) the
    reason a user sees names the variable, not the missing CuPy. (LOCKSTEP_CUDA_REPLAY is read
    when the module loads, so it fails earlier still.)"""
    from providers.cuda.provider import CudaProvider

    monkeypatch.setenv(name, "maybe")
    with pytest.raises(ProviderError, match=name):
        CudaProvider()


def test_every_switch_has_a_default_that_parses(monkeypatch):
    for name in env.SWITCHES:
        monkeypatch.delenv(name, raising=False)
    env.check_all()
    assert {name: env.switch(name) for name in env.SWITCHES}["LOCKSTEP_CUDA_GEMM_WIDE"] == "auto"


def test_every_switch_is_documented_and_named_in_the_profile_titles():
    """docs/cuda.md's switch table lists every switch, and CudaProvider.settings() (what
    ``lockstep profile`` prints in its titles, so two sweeps say which was which) reports each
    by its name without the LOCKSTEP_CUDA_ prefix (REPLAY is eager_replay)."""
    from pathlib import Path
    from types import SimpleNamespace

    from providers.cuda.provider import CudaProvider
    from providers.cuda.tuning import Tuning

    table = (Path(__file__).parents[2] / "docs" / "cuda.md").read_text()
    settings = CudaProvider.settings(SimpleNamespace(eager_replay=True, tuning=Tuning(), pdl_rows=16))
    for name in env.SWITCHES:
        assert f"| `{name}` |" in table, name
        key = name.removeprefix("LOCKSTEP_CUDA_").lower()
        assert {"replay": "eager_replay"}.get(key, key) in settings, name


@pytest.mark.parametrize("tuning,capable,pdl", [(dict(), True, "on"), (dict(pdl=False), True, "off"),
                                                (dict(), False, "off"), (dict(pdl_rows="all"), True, "on")])
def test_the_profile_shows_the_pdl_of_the_providers_tuning(tuning, capable, pdl):
    """``settings()`` (the titles of ``lockstep profile``) reports PDL as the provider runs it:
    its Tuning's switch where the device can, and the Tuning's rows."""
    from types import SimpleNamespace

    from providers.cuda import replay
    from providers.cuda.provider import CudaProvider
    from providers.cuda.tuning import Tuning

    t = Tuning(**tuning)
    settings = CudaProvider.settings(SimpleNamespace(eager_replay=True, tuning=t,
                                                     pdl_rows=replay.pdl_rows(t, capable=capable)))
    assert settings["pdl"] == pdl and settings["pdl_rows"] == t.pdl_rows


def test_pdl_is_on_unless_turned_off(monkeypatch):
    """Programmatic dependent launch is on by default (measured faster for steps of up to 16
    rows); LOCKSTEP_CUDA_PDL=0 turns it off."""
    monkeypatch.delenv("LOCKSTEP_CUDA_PDL", raising=False)
    assert env.switch("LOCKSTEP_CUDA_PDL") is True
    monkeypatch.setenv("LOCKSTEP_CUDA_PDL", "0")
    assert env.switch("LOCKSTEP_CUDA_PDL") is False
