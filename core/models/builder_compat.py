"""Run the ONNX Runtime GenAI 0.18 model builder with a config compatibility shim for transformers 5.

The 0.18 builder reads two rope fields that transformers 5 no longer keeps on a loaded config:

- Gemma 3 (``Gemma3Model.__init__``) reads ``config.rope_local_base_freq``, the rope base of the
  sliding-window layers. transformers 5 folds it into ``rope_parameters["sliding_attention"]
  ["rope_theta"]`` and drops the attribute, so the build stops with an AttributeError.
- The rope setup (``make_rope_init``) reads ``rope_parameters["rope_type"]`` (and ``factor``)
  and the base ``rope_theta`` at the top of ``rope_parameters``. transformers 5 nests them per
  layer type (``{"full_attention": {...}, "sliding_attention": {...}}``) for models with
  local/global layers, so the builder would fail on the missing key, or build the global
  layers' cache with the default base 10000.

:func:`compat_config` restores what the builder expects, from the nested values, without
changing any value the config already has: ``rope_local_base_freq`` from the sliding layers'
``rope_theta``, and the full-attention layers' rope fields copied to the top of
``rope_parameters``. Configs without nested rope parameters are left as they are.

Run as a script (not ``-m``: the process must not import a ``core`` package a user's folder
may shadow; this file imports only the standard library, transformers and the builder):

    python core/models/builder_compat.py -i HF_DIR -o OUT -p fp32 -e cpu ...   # the builder's arguments

It patches ``transformers.AutoConfig.from_pretrained`` (the builder's only way to load the
config) to pass every loaded config through :func:`compat_config`, then runs
``onnxruntime_genai.models.builder`` as ``__main__``.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path
from typing import Any


def _missing(config: Any, name: str) -> bool:
    try:
        getattr(config, name)
    except AttributeError:
        return True
    return False


def compat_config(config: Any) -> list[str]:
    """Patch a loaded transformers config (and its ``text_config``) in place for the 0.18 builder.

    Args:
        config: a ``transformers.PretrainedConfig`` (any object with attributes).

    Returns:
        The fields set, e.g. ``["rope_local_base_freq", "rope_parameters.rope_theta"]`` (empty
        when the config needed nothing).
    """
    changed: list[str] = []
    for cfg in (config, getattr(config, "text_config", None)):
        if cfg is None:
            continue
        rope = getattr(cfg, "rope_parameters", None)
        if not isinstance(rope, dict):
            continue
        full, local = rope.get("full_attention"), rope.get("sliding_attention")
        if isinstance(full, dict):
            for key, value in full.items():
                if key not in rope:
                    rope[key] = value
                    changed.append(f"rope_parameters.{key}")
        if isinstance(local, dict) and "rope_theta" in local and _missing(cfg, "rope_local_base_freq"):
            cfg.rope_local_base_freq = local["rope_theta"]
            changed.append("rope_local_base_freq")
    return changed


def _install() -> None:
    """Make ``AutoConfig.from_pretrained`` return configs passed through :func:`compat_config`."""
    from transformers import AutoConfig

    original = AutoConfig.from_pretrained.__func__
    told: set[str] = set()

    def from_pretrained(cls, *args, **kwargs):
        config = original(cls, *args, **kwargs)
        changed = ", ".join(compat_config(config))
        if changed and changed not in told:  # the builder loads the config several times
            told.add(changed)
            print(f"lockstep: set {changed} from rope_parameters for the 0.18 builder "
                  "(core/models/builder_compat.py)", flush=True)
        return config

    AutoConfig.from_pretrained = classmethod(from_pretrained)


def main() -> None:
    """Run the builder with the shim; ``sys.argv[1:]`` are the builder's own arguments."""
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]  # no sibling shadows a package
    _install()
    sys.argv[0] = "onnxruntime_genai.models.builder"
    runpy.run_module("onnxruntime_genai.models.builder", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
