"""The ``lockstep`` command (also ``python -m lockstep``, which a folder holding its own ``core/`` cannot shadow).

    lockstep run [--model DIR|NAME] [--provider P] --prompt A [--prompt B ...] [--prompt -]
                 [--prompt-file FILE] [--max-new-tokens N] [--raw] [--json]
                 [--layout head_major|seq_major] [--no-capture]
    lockstep prepare [NAME|HF_DIR|FILE.gguf] [--precision fp32|int4|fp16] [--target cpu|cuda] [--output DIR]
    lockstep prepare --list
    lockstep chat [--model DIR|NAME] [--provider P] [--system TEXT] [sampling options]
    lockstep cache [clean [NAME ...] [--dry-run]]
    lockstep providers
    lockstep parity --provider P [--model DIR] [--full] [--batch 1,2] [--steps 4] [--json]
    lockstep profile MODEL --provider P --batch-sweep 1,2,4 --tokens T --context L [...]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
from pathlib import Path
from typing import NoReturn

from rich.console import Console
from rich.markup import escape

from core import plugins
from core.cli_args import (
    check_listen,
    flag_names,
    int_list,
    non_negative_int,
    positive_float,
    positive_int,
    unknown_hint,
)
from core.cli_work import (
    check_expert_budget,
    compile_ahead,
    compiles,
    cpu_threads,
    drain,
    expert_runner,
    prompt_numbers,
    reply,
    tcp_port,
)
from core.models import cache as cache_command
from core.models.prepare import (
    DEFAULT_MODEL,
    MODELS,
    PRECISIONS,
    REFUSED_VARIANTS,
    TARGETS,
    VARIANTS,
    PrepareError,
    Variant,
    cached_folder,
    default_variant,
    prepare,
    resolve_model,
    source_kind,
)
from core.threads import ENV, ThreadsError

console = Console(stderr=True, soft_wrap=True)  # an error stays one line in logs


def _table_console() -> Console:
    """Stdout console; wide enough for the tables when stdout is not a terminal."""
    out = Console()
    return out if out.is_terminal else Console(width=220)


@contextlib.contextmanager
def _status(text: str):
    """A spinner on a terminal; plain lines in logs. Yields a callable taking a new status."""
    if console.is_terminal:
        with console.status(escape(text)) as status:
            yield lambda line: status.update(escape(line))
    else:
        console.print(text, markup=False)
        yield lambda line: console.print(line, markup=False)


def _resolve_model(model: str | None, provider: str):
    """The builder folder of ``--model``: a builder folder as is; a name, a Hugging Face folder
    or a .gguf file prepared (once, then cached) for the provider's default variant."""
    if model is not None and source_kind(model) == "builder":
        return model
    precision, target = default_variant(provider)
    cached = cached_folder(Variant(DEFAULT_MODEL if model is None else str(model), precision, target))
    if cached is not None:
        return cached  # no status line: nothing is prepared
    what = "the default model" if model is None else model
    with _lazy_status(f"preparing {what} ({precision}/{target}; built once, then cached)") as update:
        return resolve_model(model, precision, target, progress=update)


@contextlib.contextmanager
def _lazy_status(text: str):
    """:func:`_status`, opened at the first status line only: a path source already in the cache
    (its content hash remembered) is found without one, so says nothing."""
    with contextlib.ExitStack() as stack:
        shown: list = []

        def update(line: str) -> None:
            if not shown:
                shown.append(stack.enter_context(_status(text)))
            shown[0](line)

        yield update


def read_prompts(data: bytes, source: str) -> list[str]:
    """Prompts from a file or stdin: one per line (blank lines skipped), or JSONL when the
    first non-blank line starts with ``{`` or ``"``: each line a JSON string or an object with
    a ``"prompt"`` string (so a prompt can hold newlines).

    Raises:
        RequestError: the bytes are not UTF-8, a JSONL line is malformed, or there is no prompt.
    """
    from core.session import RequestError

    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise RequestError(f"{source} is not UTF-8 text (byte {exc.start})") from None
    lines = [(n, line) for n, line in enumerate(text.splitlines(), start=1) if line.strip()]
    if not lines:
        raise RequestError(f"{source} holds no prompt")
    if not lines[0][1].lstrip().startswith(("{", '"')):
        return [line for _, line in lines]
    prompts = []
    for n, line in lines:
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise RequestError(f"{source} line {n} is not JSON ({exc.msg}); JSONL needs one JSON "
                               "string or {\"prompt\": ...} object per line") from None
        if isinstance(item, dict):
            item = item.get("prompt")
        if not isinstance(item, str):
            raise RequestError(f"{source} line {n}: expected a JSON string or an object with a "
                               "\"prompt\" string")
        prompts.append(item)
    return prompts


def _prompts(a) -> list[str]:
    """The prompts of ``lockstep run``: each --prompt (``-`` reads stdin), then --prompt-file."""
    from core.session import RequestError

    out: list[str] = []
    for prompt in a.prompt or []:
        if prompt == "-":
            if a.prompt.count("-") > 1:
                raise RequestError("--prompt - (stdin) can be given once")
            out += read_prompts(sys.stdin.buffer.read(), "stdin")
        else:
            out.append(prompt)
    for name in a.prompt_file or []:
        path = Path(name).expanduser()
        if not path.is_file():
            raise RequestError(f"prompt file {name} is a folder, not a file" if path.is_dir()
                               else f"prompt file not found: {name}")
        out += read_prompts(path.read_bytes(), str(name))
    if not out:
        raise RequestError("give a prompt: --prompt TEXT, --prompt - (stdin) or --prompt-file FILE")
    return out


def _rate(tokens_per_s: float | None) -> str:
    return "-" if tokens_per_s is None else f"{tokens_per_s:,.1f} tok/s"


def cmd_run(a) -> int:
    from core.session import RequestError

    prompts = _prompts(a)
    try:
        return _run(a, prompts)
    except RequestError as exc:  # the library counts prompts from 0; the command line from 1
        raise RequestError(prompt_numbers(str(exc), len(prompts))) from None


def _run(a, prompts: list[str]) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from core.generation.generate import check_prompt_texts, check_request
    from core.session import RequestError

    check_prompt_texts(prompts)  # before any model build
    provider = plugins.get_provider(a.provider)  # a missing provider is reported before any model build
    options = _generation_options(a)
    if a.tensor_parallel != 1 and a.do_sample:
        from core.parallel.session import GREEDY_ONLY

        raise RequestError(GREEDY_ONLY.split(":")[0] + ": drop --do-sample")
    check_request(a.max_new_tokens, {k: v for k, v in options.items() if k not in ("stop", "system")},
                  options.get("stop"), a.weight_budget, a.device_budget, a.tensor_parallel)  # before any build
    check_expert_budget(a)
    model = _resolve_model(a.model, a.provider)
    _note_greedy(a, model)
    if a.stream:
        return _run_streamed(a, prompts, model, provider, options)
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True, disable=not console.is_terminal) as bar:
        rows = "1 prompt" if len(prompts) == 1 else f"{len(prompts)} prompts"
        task = bar.add_task(f"loading the model for {rows}", total=a.max_new_tokens)

        def progress(done: int, total: int) -> None:
            text = f"prefill of {rows}" if done == 0 else "decoding"
            bar.update(task, completed=done, description=text)

        def compiling(what: str, cache: str) -> None:
            bar.update(task, description=f"compiling {a.provider} kernels, first run only, cached in {cache}: {what}")

        with compiles(a, compiling):
            result, interrupted = drain(a, _start(a, prompts, model, provider, options, progress), lambda d: None)
    if a.json:
        print(json.dumps(_json(a, result), indent=2))
    else:
        for prompt, row in zip(prompts, result.rows):
            if len(prompts) > 1:
                print(f"### {prompt}")
            print(row.text)
    return _interrupted(a, result) if interrupted else _report(a, result)


def _start(a, prompts: list[str], model, provider, options: dict, progress=None):
    """The :class:`~core.generation.generate.Stream` of ``lockstep run``'s request."""
    from core.generation.generate import start

    runner = expert_runner(a, model, provider)  # --expert-budget: a Runner with the budgets
    return start(runner, provider=provider, prompts=prompts, max_new_tokens=a.max_new_tokens, chat=not a.raw,
                 kv_layout=a.layout, capture=False if a.no_capture else None, weight_budget=a.weight_budget,
                 device_budget=a.device_budget if runner is model else None, progress=progress,
                 tensor_parallel=a.tensor_parallel, **options)


def _json(a, result) -> dict:
    """``run --json``: the result's data and the BLAS threads it ran with."""
    return {**result.to_dict(), "cpu_threads": a.cpu_threads}


def _interrupted(a, result) -> int:
    """The report of a run stopped by Ctrl-C; returns 130, the status of a command it stopped."""
    _report(a, result)
    made = sum(len(r.output_ids) for r in result.rows)
    console.print(f"[yellow]interrupted[/yellow] (Ctrl-C): kept the {_tokens(made)} made so far, each row with "
                  "finish reason \"interrupted\"")
    return 130


#: Compile seconds from which ``lockstep run`` names the compile (a disk-cache hit takes milliseconds).
COMPILE_NOTE_S = 0.5


def _report(a, result) -> int:
    """The rates and finish line on stderr (text mode), failed rows on stderr (always); returns
    the exit status: 1 when every row failed (non-finite logits), else 0."""
    if not a.json:
        c = result.counters
        tokens = sum(len(r.output_ids) for r in result.rows)
        rows = "1 row" if len(result.rows) == 1 else f"{len(result.rows)} rows"
        if not c["prefill_tokens"] and not c["decode_steps"]:  # --max-new-tokens 0: nothing ran
            console.print(f"[dim]{result.provider}: {rows}, no tokens asked for (--max-new-tokens 0): "
                          "nothing was prefilled or decoded[/dim]")
            return 0
        console.print(f"[dim]{result.provider}: {rows}, {_tokens(tokens)}; prefill "
                      f"{_tokens(c['prefill_tokens'])} in {c['prefill_s'] * 1e3:.0f} ms "
                      f"({_rate(result.prefill_tokens_per_s)}); decode {c['decode_steps']} steps in "
                      f"{c['decode_s'] * 1e3:.0f} ms ({_rate(result.decode_tokens_per_s)})[/dim]")
        if c.get("compile_s", 0) >= COMPILE_NOTE_S:
            console.print(f"[dim]kernels compiled in {c['compile_s']:.1f} s, not counted in the rates (first run "
                          f"only; cached in {escape(getattr(a, 'compile_cache', 'the provider cache'))})[/dim]")
        if c.get("weight_bytes_streamed_per_step"):  # --weight-budget / --device-budget streamed weights
            console.print(f"[dim]weights: {_size(c['weight_bytes_resident'])} resident, "
                          f"{_size(c['weight_bytes_streamed_per_step'])} streamed a step through "
                          f"{_size(c['staging_bytes'])} of staging; {_size(c['htod_bytes_per_token'])} "
                          f"host-to-device per token, byte hit rate {c['byte_hit_rate']:.0%}[/dim]")
        console.print("[dim]finish: " + "; ".join(
            f"{'' if len(result.rows) == 1 else f'row {i} '}{r.finish_reason} ({_tokens(len(r.output_ids))})"
            for i, r in enumerate(result.rows)) + "[/dim]")
    failed = [i for i, r in enumerate(result.rows) if r.finish_reason == "error"]
    for i in failed:
        console.print(f"[red]error:[/red] row {i}: the logits became NaN or infinite after "
                      f"{len(result.rows[i].output_ids)} tokens; its text stops there")
    return 1 if failed and len(failed) == len(result.rows) else 0


def _size(n: float) -> str:
    """Bytes for a person: KiB under a MiB, MiB under a GiB, else GiB (binary units)."""
    for unit, scale in (("KiB", 1 << 10), ("MiB", 1 << 20)):
        if n < scale << 10:
            return f"{n / scale:,.1f} {unit}"
    return f"{n / (1 << 30):,.2f} GiB"


def _tokens(n: int) -> str:
    return "1 token" if n == 1 else f"{n} tokens"


def _generation_options(a) -> dict:
    """Sampling, stop and system options of ``run`` / ``chat`` as core.run keyword arguments."""
    from core.generation.sampling import OPTION_NAMES

    out = {name: getattr(a, name) for name in OPTION_NAMES if getattr(a, name, None) is not None}
    if getattr(a, "stop", None):
        out["stop"] = list(a.stop)
    if getattr(a, "system", None) is not None:
        out["system"] = a.system
    return out


def _note_greedy(a, model) -> None:
    """One line on stderr when sampling options were given to a request that decodes greedily
    (neither ``--do-sample`` nor the model's genai_config.json "search" do_sample), as
    transformers warns: they change nothing then."""
    given = [name for name in ("temperature", "top_k", "top_p", "min_p") if getattr(a, name, None) is not None]
    if not given or a.do_sample:
        return
    if a.do_sample is None:  # the model's default decides (core.generation.sampling.search_defaults)
        from core.generation.sampling import search_defaults

        with contextlib.suppress(OSError, ValueError, AttributeError):
            if search_defaults(json.loads((Path(model) / "genai_config.json").read_text()).get("search")).do_sample:
                return
    flags = ", ".join("--" + name.replace("_", "-") for name in given)
    console.print(f"[yellow]note:[/yellow] {flags} {'applies' if len(given) == 1 else 'apply'} only with "
                  "--do-sample; decoding greedily")


def _run_streamed(a, prompts: list[str], model, provider, options: dict) -> int:
    """``run --stream``: one prompt's text as it is decoded; several prompts: each row printed
    whole as soon as it ends (interleaved rows are unreadable)."""
    texts = [""] * len(prompts)
    out = sys.stderr if a.json else sys.stdout  # with --json, stdout holds the JSON alone

    def show(d) -> None:
        if len(prompts) == 1:
            out.write(d.text)
            out.flush()
        else:
            texts[d.row] += d.text
            if d.finish_reason is not None:
                print(f"### {prompts[d.row]}\n{texts[d.row]}", file=out, flush=True)

    with compiles(a):
        result, interrupted = drain(a, _start(a, prompts, model, provider, options), show)
    if len(prompts) == 1:
        print(file=out)
    if a.json:
        print(json.dumps(_json(a, result), indent=2))
    return _interrupted(a, result) if interrupted else _report(a, result)


def cmd_serve(a) -> int:
    """``lockstep serve``: an OpenAI-compatible server over the engine (core.serve, docs/serving.md)."""
    from core.session import RequestError

    try:
        from core.serve.server import build_server, serve
    except ImportError as exc:
        raise RequestError(f"lockstep serve needs the serve extra ({exc.name} is missing): "
                           'pip install -e ".[serve]"') from None
    if a.model_option is not None:
        if a.model is not None and a.model != a.model_option:
            raise RequestError(f"two models given: {a.model} and --model {a.model_option}; give one")
        a.model = a.model_option
    _check_budgets(a)
    plugins.get_provider(a.provider)
    if a.api_key is not None and not a.api_key.strip():  # `--api-key "$KEY"` with KEY unset
        raise RequestError("--api-key is empty; give the key clients send as Authorization: Bearer KEY, "
                           "or leave the flag out for no key")
    check_listen(a.host, a.port)  # before the model is prepared or loaded
    model = _resolve_model(a.model, a.provider)
    server = build_server(model, a.provider, a.max_batch, a.capacity, a.max_waiting, False if a.no_capture else None,
                          a.model_name or Path(a.model or DEFAULT_MODEL).name, a.api_key, a.prefill_chunk,
                          a.weight_budget, a.device_budget, tensor_parallel=a.tensor_parallel,
                          decode_prefill_tokens=a.decode_prefill_tokens, expert_budget=a.expert_budget)
    serve(server, a.host, a.port, a.log_level)
    return 0


def cmd_chat(a) -> int:
    from core.generation.chat import Conversation
    from core.generation.generate import check_request
    from core.session import RequestError, Session

    provider = plugins.get_provider(a.provider)
    options = _generation_options(a)
    system = options.pop("system", None)
    options.pop("stop", None)
    check_request(a.max_new_tokens, options)  # before any model build
    model = _resolve_model(a.model, a.provider)
    _note_greedy(a, model)
    session = Session(model, provider, batch=1, capture=False if a.no_capture else None)
    context = session.model.config.context_length
    if a.max_new_tokens >= context:  # no turn could ever fit: refuse now, not at every turn
        raise RequestError(f"max_new_tokens={a.max_new_tokens} leaves no room for a prompt in the model's "
                           f"context of {context} positions; give at most {context - 1}, less the longest turn")
    talk = Conversation(session, system=system, max_new_tokens=a.max_new_tokens, sampling=options or None)
    console.print("[dim]chat: an empty line or /exit ends, /reset starts over, Ctrl-C stops a reply[/dim]")
    failed = 0
    while True:
        try:
            line = input("> " if sys.stdin.isatty() else "")
        except EOFError:
            break
        except KeyboardInterrupt:  # at the prompt: drop the line being typed, keep the conversation
            console.print("\n[dim](an empty line, /exit or Ctrl-D ends the chat)[/dim]")
            continue
        if line.strip() in ("", "/exit"):
            break
        if line.strip() == "/reset":
            talk = Conversation(session, system=system, max_new_tokens=a.max_new_tokens, sampling=options or None)
            continue
        try:
            line.encode("utf-8")
        except UnicodeEncodeError:  # undecodable input bytes (surrogates): nothing was sent
            console.print("[red]error:[/red] that line is not valid UTF-8 text; it was not sent")
            failed += 1
            continue
        try:
            reply(talk, line, console)
        except RequestError as exc:  # e.g. the conversation outgrew the cache: say so, keep going
            console.print(f"[red]error:[/red] {escape(flag_names(str(exc)))}")
            failed += 1
            continue
    return 1 if failed else 0


def _sampling_args(parser: argparse.ArgumentParser, stop: bool = True) -> None:
    g = parser.add_argument_group("generation (defaults: the model's genai_config.json \"search\")")
    g.add_argument("--do-sample", dest="do_sample", action=argparse.BooleanOptionalAction, default=None,
                   help="sample instead of greedy decoding")
    g.add_argument("--temperature", type=float, help="divides the logits (0: greedy)")
    g.add_argument("--top-k", dest="top_k", type=int, help="keep the k most probable tokens (0: off)")
    g.add_argument("--top-p", dest="top_p", type=float, help="nucleus mass in (0, 1] (1: off)")
    g.add_argument("--min-p", dest="min_p", type=float, help="keep tokens >= min_p x the best one's probability")
    g.add_argument("--repetition-penalty", dest="repetition_penalty", type=float,
                   help="penalise tokens already in the row (1: off)")
    g.add_argument("--seed", type=int, help="random seed of every row (default: drawn per request)")
    g.add_argument("--system", help="system prompt (instead of the chat template's default)")
    if stop:
        g.add_argument("--stop", action="append", help="a stop string; repeat for several")


def _print_known_models() -> None:
    from rich.table import Table

    table = Table("model", "source")
    for name, info in MODELS.items():
        table.add_row(name + (" (default)" if name == DEFAULT_MODEL else ""), escape(info["description"]))
    table.add_row("HF_DIR", "a local Hugging Face folder (config.json, *.safetensors, tokenizer files)")
    table.add_row("FILE.gguf", "a local GGUF file (read by transformers)")
    variants = Table("precision/target", "what the folder holds")
    for (precision, target), text in VARIANTS.items():
        variants.add_row(f"{precision}/{target}", text)
    for (precision, target), text in REFUSED_VARIANTS.items():
        variants.add_row(f"{precision}/{target}", f"not offered: {escape(text)}")
    out = _table_console()
    out.print(table)
    out.print(variants)


def cmd_prepare(a) -> int:
    if a.list:
        ignored = [name for name, given in (("--precision", a.precision is not None), ("--target", a.target != "cpu"),
                                            ("--output", a.output is not None), ("--force", a.force),
                                            (a.model, a.model != DEFAULT_MODEL)) if given]
        if ignored:
            from core.session import RequestError

            raise RequestError(f"--list builds nothing and lists every model and variant; drop {' '.join(ignored)}")
        _print_known_models()
        return 0
    if a.precision is None:
        a.precision = default_variant(a.target)[0]
    variant = Variant(a.model, a.precision, a.target)  # a bad name or pair is refused before any status line
    with _status(f"preparing {a.model} {a.precision} for {a.target}") as update:
        try:
            path = prepare(variant, output=a.output, progress=update, force=a.force)
        except PrepareError as exc:  # the library says "the output"; the command line typed --output
            text = str(exc).replace("the output's folder", "the folder of --output")
            raise PrepareError(re.sub(r"\bthe output(?: folder)? (?=/|\S)", "--output ", text)) from None
    if a.target == "cuda" and not a.no_compile:
        compile_ahead(path, console, _status)
    print(path)
    return 0


def cmd_providers(a) -> int:
    from rich.table import Table


    reg = plugins.registry()
    table = Table("provider", "package", "capabilities", "protocol", "description")
    for name in reg.names():
        entry = reg.entries[name]
        try:
            caps = reg.create(name).capabilities()
            text = (f"dtypes {','.join(caps.dtypes)}; capture {'yes' if caps.graph_capture else 'no'}; "
                    f"vmm {'yes' if caps.vmm else 'no'}; layouts {','.join(caps.kv_layouts)}")
            proto = str(caps.protocol_version)
        except Exception as exc:  # noqa: BLE001 - show why it is unusable here
            text, proto = f"[red]unavailable: {escape(str(exc))}[/red]", "?"
        table.add_row(name, escape(entry.package), text, proto, escape(entry.spec.description))
    _table_console().print(table)
    for err in reg.errors:
        console.print(f"[red]{escape(str(err))}[/red]")
    return 0


def _check_budgets(a) -> None:
    """``--weight-budget`` and ``--device-budget`` (where the command has them) read before any
    model work.

    Raises:
        core.session.RequestError: a budget that reads as none, worded with its flag.
    """
    from core.generation.generate import check_request
    from core.session import RequestError

    try:
        check_request(1, None, None, a.weight_budget, getattr(a, "device_budget", None))
    except RequestError as exc:
        raise RequestError(flag_names(str(exc))) from None
    check_expert_budget(a)


def cmd_parity(a) -> int:
    from core.testing.parity import run_kit

    _check_budgets(a)
    provider = plugins.get_provider(a.provider)  # a missing provider is reported before any model build
    model = _resolve_model(a.model, a.provider)
    mode = "full" if a.full else "quick"
    with _status(f"parity of {a.provider} against cpu_reference ({mode} mode)") as update:
        report = run_kit(model, provider, mode, batches=a.batch, steps=a.steps, weight_budget=a.weight_budget,
                         progress=update)
    if a.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(report.render())
    return 0 if report.passed else 1


def cmd_plan(a) -> int:
    from core.plan import main as plan_main

    _check_budgets(a)
    if a.provider not in plugins.registry().names():  # installed but unusable here (no GPU) plans on
        raise plugins.ProviderError(f"unknown provider {a.provider!r}; installed: {plugins.registry().describe()}")
    if source_kind(a.model) != "builder":  # a name or a Hugging Face folder, as run takes
        a.model = _resolve_model(a.model, a.provider)
    return plan_main(a, _table_console())  # the plan is the command's output: stdout, full width


def cmd_profile(a) -> int:
    from core.profile import check_outputs, profile_main
    from core.session import RequestError
    from core.sweep import apply_defaults

    apply_defaults(a)

    if a.tensor_tflops is not None and not a.kernels:
        raise RequestError("--tensor-tflops sets the FLOPs floor of the --kernels table; add --kernels")
    _check_budgets(a)
    plugins.get_provider(a.provider)  # a missing or unusable provider is reported before any model build
    if not a.kernels:
        check_outputs(a)  # --plot, --json and --anchor too
    a.model = _resolve_model(a.model, a.provider)
    if a.kernels:  # the CLI dispatches --kernels: core.profile does not import core.kernel_profile
        from core.kernel_profile import kernels_main

        return kernels_main(a, console, _table_console())
    return profile_main(a, console, _table_console())


def _budget_arg(parser: argparse.ArgumentParser, device: bool = True) -> None:
    parser.add_argument("--weight-budget", metavar="BYTES|PCT", help="device bytes for weights, staging "
                        "included (2GiB, 512MB, 40%%, 0.4); the rest stream from pinned host memory "
                        "every step (default: everything resident when it fits)")
    if device:
        parser.add_argument("--device-budget", metavar="BYTES", help="device bytes for weights and KV together "
                            "(4GiB): KV growth takes from the weight budget, so more weights stream")
        parser.add_argument("--expert-budget", metavar="BYTES|PCT", help="device bytes for a MoE model's "
                            "experts (1GiB, 25%%): the most-used stay, the rest page into a ring of expert slots")


def _threads_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=positive_int, metavar="N", help="BLAS threads of the host math "
                        f"(default: ${ENV}, else chosen per provider and workload: the idle cores for "
                        "cpu_reference, 1 for a GPU provider and for parity; docs/first-day.md)")


def _version() -> str:
    import core

    return f"lockstep {core.__version__} ({Path(core.__file__).parent})"


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors, like the command's own checks (``lockstep run: error: ...``)
    rather than the whole usage block first; exits with status 2 as argparse does."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of ``lockstep`` (one subcommand per job)."""
    p = _Parser(prog="lockstep", description="Batch-N decoding of ONNX LLMs on "
                "pluggable execution providers.")
    p.add_argument("--version", action="version", version=_version())
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("run", help="decode prompts as one batch (greedy unless --do-sample)")
    r.add_argument("--model", help="builder folder, Hugging Face folder, .gguf file or model name "
                   "(default: smollm2-135m; prepared on first use, then cached)")
    r.add_argument("--provider", default="cpu_reference", help="execution provider (see `lockstep "
                   "providers`; default: %(default)s)")
    r.add_argument("--prompt", action="append", help="a prompt; repeat for a batch; - reads prompts "
                   "from stdin like --prompt-file")
    r.add_argument("--prompt-file", action="append", metavar="FILE", help="prompts, one per line, or "
                   "JSONL (a JSON string or {\"prompt\": ...} per line); repeatable")
    r.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per row "
                   "(default: %(default)s)")
    r.add_argument("--raw", action="store_true", help="do not apply the chat template")
    r.add_argument("--json", action="store_true", help="print rows, provider and counters as JSON")
    r.add_argument("--layout", default="head_major", choices=["head_major", "seq_major"],
                   help="KV cache layout (default: %(default)s)")
    r.add_argument("--no-capture", action="store_true", help="never capture decode steps")
    r.add_argument("--stream", action="store_true", help="print text as it is decoded")
    r.add_argument("--tensor-parallel", type=positive_int, default=1, metavar="R", help="shard the model "
                   "over R rank processes (greedy only; docs/parallel.md; default: %(default)s)")
    _budget_arg(r)
    _threads_arg(r)
    _sampling_args(r)
    r.set_defaults(func=cmd_run)

    c = sub.add_parser("chat", help="an interactive chat (one line per turn; the KV cache carries on)",
                       description="An interactive chat: type a line, the model replies; the conversation "
                       "carries on in the KV cache.",
                       epilog="In the chat: /reset starts a new conversation; /exit, an empty line or Ctrl-D "
                       "ends it. Ctrl-C stops the current reply and keeps it, as far as it got, in the "
                       "conversation (press it twice to quit at once); at the prompt it clears the line.")
    c.add_argument("--model", help="builder folder, Hugging Face folder, .gguf file or model name "
                   "(default: smollm2-135m; prepared on first use, then cached)")
    c.add_argument("--provider", default="cpu_reference", help="execution provider (default: %(default)s)")
    c.add_argument("--max-new-tokens", type=positive_int, default=256, help="most tokens per reply "
                   "(default: %(default)s)")
    c.add_argument("--no-capture", action="store_true", help="never capture decode steps")
    _threads_arg(c)
    _sampling_args(c, stop=False)
    c.set_defaults(func=cmd_chat)

    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server with continuous batching")
    s.add_argument("model", nargs="?", help="builder folder, Hugging Face folder, .gguf file or model name "
                   "(default: smollm2-135m)")
    s.add_argument("--provider", default="cpu_reference", help="execution provider (default: %(default)s)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    s.add_argument("--port", type=tcp_port, default=8000, help="port (default: %(default)s)")
    s.add_argument("--max-batch", type=positive_int, default=64, help="KV slots: requests decoded at once "
                   "(default: %(default)s)")
    s.add_argument("--capacity", type=positive_int, default=None, help="KV positions per slot, prompt plus "
                   "max_tokens - 1 (default: 2048, at most the model context)")
    s.add_argument("--max-waiting", type=positive_int, default=256, help="requests queued for a slot before "
                   "answering 429 (default: %(default)s)")
    s.add_argument("--prefill-chunk", type=positive_int, default=256, help="prompt positions per prefill chunk; "
                   "the running requests decode between chunks (default: %(default)s)")
    s.add_argument("--decode-prefill-tokens", type=positive_int, help="prompt positions prefilled between two "
                   "decode steps while requests decode (default: 2048; one chunk: lower inter-token latency)")
    s.add_argument("--api-key", help="require Authorization: Bearer KEY on /v1 routes")
    s.add_argument("--model", dest="model_option", metavar="MODEL", help="the model, as the positional MODEL "
                   "(vLLM's spelling; without it --model would abbreviate --model-name)")
    s.add_argument("--model-name", help="the name clients pass as model (default: MODEL's last path part)")
    s.add_argument("--no-capture", action="store_true", help="never capture decode steps")
    s.add_argument("--tensor-parallel", type=positive_int, default=1, metavar="R", help="shard the model over R "
                   "rank processes (greedy requests only; default: %(default)s)")
    _budget_arg(s)
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    s.set_defaults(func=cmd_serve)

    q = sub.add_parser("prepare", help="build a model variant with the ONNX Runtime GenAI builder",
                       epilog="known models: " + ", ".join(MODELS) + " (lockstep prepare --list shows "
                       "them and the offered precision/target pairs)")
    q.add_argument("model", nargs="?", default=DEFAULT_MODEL, help="a known model name, a Hugging "
                   "Face folder or a .gguf file (default: %(default)s)")
    q.add_argument("--list", action="store_true", help="list the known models and variants, build nothing")
    q.add_argument("--precision", choices=PRECISIONS, help="weights and activations (default: "
                   "fp32 for cpu, fp16 for cuda; offered: " + ", ".join(f"{p}/{t}" for p, t in VARIANTS) + ")")
    q.add_argument("--target", default="cpu", choices=TARGETS, help="the builder's execution "
                   "provider: cpu writes fp32 I/O, cuda fp16 I/O (default: %(default)s)")
    q.add_argument("--output", help="folder to write (default: the cache)")
    q.add_argument("--force", action="store_true", help="rebuild even if cached")
    q.add_argument("--no-compile", action="store_true", help="with --target cuda: do not compile the cuda "
                   "kernels ahead (default: compiled once the folder is built, where a GPU is usable, so that "
                   "the first run does not wait for them)")
    q.set_defaults(func=cmd_prepare)

    cache_command.add_parser(sub)

    v = sub.add_parser("providers", help="list installed providers")
    v.set_defaults(func=cmd_providers)

    t = sub.add_parser("parity", help="decode gates of a provider against cpu_reference")
    t.add_argument("--provider", required=True, help="the provider under test")
    t.add_argument("--model", help="builder folder, Hugging Face folder, .gguf file or model name "
                   "(default: smollm2-135m, prepared for the provider on first use)")
    t.add_argument("--full", action="store_true", help="every gate on the model, batches 1,2,8 for 64 steps "
                   "(default: the quick mode, seconds on a CPU once the model is prepared: every gate on a "
                   "tiny model of the same dtype, then the logits, greedy, batch-invariance and prompt gates "
                   "on the model, batches 1,2 for 4 steps)")
    t.add_argument("--batch", type=int_list, default=None,
                   help="batch sizes of the gates on the model, e.g. 1,2,8 (default: 1,2; with --full 1,2,8)")
    t.add_argument("--steps", type=positive_int, default=None, help="decode steps on the model (default: 4; "
                   "with --full 64)")
    t.add_argument("--json", action="store_true", help="print the report as JSON")
    _budget_arg(t, device=False)
    _threads_arg(t)
    t.set_defaults(func=cmd_parity)

    f = sub.add_parser("profile", help="decode throughput sweep over batch sizes")
    f.add_argument("model", help="builder folder, Hugging Face folder, .gguf file or model name")
    f.add_argument("--provider", default="cpu_reference", help="provider (default: %(default)s)")
    f.add_argument("--batch-sweep", type=int_list, default=None,
                   help="batch sizes, comma-separated (default: 1,2,4,8 on cpu_reference, else 1,2,4,...,256)")
    f.add_argument("--tokens", type=positive_int, default=None, help="measured decode steps per batch "
                   "(default: 16 on cpu_reference, else 64)")
    f.add_argument("--warmup", type=non_negative_int, default=8, help="decode steps before measuring, including "
                   "capture warm-up and capture (default: %(default)s)")
    f.add_argument("--context", type=positive_int, default=512, help="KV capacity in tokens, raised "
                   "to fit a longer prompt and its steps (default: %(default)s)")
    f.add_argument("--prompt-len", type=int_list, default=[16], help="prompt tokens per row, "
                   "comma-separated for a context sweep, e.g. 32,512,1024,4096 (default: 16)")
    f.add_argument("--layout", default="head_major", choices=["head_major", "seq_major"],
                   help="KV cache layout (default: %(default)s)")
    f.add_argument("--no-capture", action="store_true", help="run every step eagerly")
    f.add_argument("--no-run-ahead", action="store_true", help="read each step's tokens before queueing the "
                   "next (the synchronous loop, for comparison; default: the next steps are queued first)")
    f.add_argument("--kernels", action="store_true", help="time every node of eager decode steps and of "
                   "one prefill, and print where their time goes (op, kernel, calls, GPU us, bytes, floor); "
                   "needs a provider that can time its nodes")
    f.add_argument("--tensor-tflops", type=float, default=None, metavar="TFLOPS", help="with --kernels: "
                   "the tensor rate the FLOPs floor uses (default: bytes floor only)")
    _budget_arg(f)
    _threads_arg(f)
    f.add_argument("--json", dest="json_out", help="write the rows as JSON to this file")
    f.add_argument("--anchor", metavar="FILE", help="put another runtime's tokens/s beside each row: the "
                   "--json file of benchmarks/ort_genai_decode.py (same prompt lengths and batches)")
    f.add_argument("--plot", dest="plot_out", help="write tokens/s against batch as a PNG "
                   "(needs the plot extra: pip install -e \".[plot]\")")
    f.set_defaults(func=cmd_profile)
    g = sub.add_parser("plan", help="the residency plan of a model under a budget, before loading it "
                       "(sizes from the ONNX header; no weight is read)")
    g.add_argument("model", help="builder folder or model name (as run's --model)")
    g.add_argument("--provider", default="cuda", help="provider whose fusion rules and measured bandwidths "
                   "the plan uses (default: %(default)s; cpu_reference's rules when it cannot start)")
    g.add_argument("--batch", type=int_list, default=[1, 8, 32], help="batch sizes (default: 1,8,32)")
    g.add_argument("--context", type=positive_int, default=None, help="KV tokens per row, at most the model "
                   "context (default: 2048, or the model context when shorter)")
    g.add_argument("--staging-slots", type=positive_int, default=None, help="staging ring slots "
                   "(default: one layer's streamed pages plus one)")
    g.add_argument("--page-size", default=None, metavar="BYTES", help="page size of streamed row blocks, "
                   "bytes or a size (64MiB) (default: $LOCKSTEP_PAGE_BYTES, else the largest node that cannot "
                   "be cut, at least 64 MiB)")
    g.add_argument("--h2d-gbps", type=positive_float, default=None, help="host-to-device GB/s for the copy floor "
                   "(default: measured by the provider)")
    g.add_argument("--json", action="store_true", help="print the rows as JSON")
    _budget_arg(g)
    g.set_defaults(func=cmd_plan)
    for command in sub.choices.values():  # an unknown flag is reported with its command's usage
        command.set_defaults(command_parser=command)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``lockstep`` and ``python -m lockstep``; returns the exit status (2 for a
    refused request, printed as one line without traceback; 130 when interrupted; 0, quietly,
    when the reader of stdout closes it early, as ``| head`` does)."""
    from core.errors import USER_ERRORS
    from core.parallel.session import RankError

    parser = build_parser()
    given = sys.argv[1:] if argv is None else argv
    if not given:  # bare `lockstep`: the commands, not only "a command is required"
        parser.print_help(sys.stderr)
        return 2
    if given and given[0].startswith("-") and given[0] not in ("-h", "--help", "--version"):
        parser.error(f"unrecognized arguments: {given[0]} (options follow the command: lockstep run --help)")
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        args.command_parser.error(f"unrecognized arguments: {' '.join(unknown)}{unknown_hint(args, unknown)}")
    try:
        with cpu_threads(args):
            return args.func(args)
    except USER_ERRORS + (ThreadsError,) as exc:
        # a request the generation library refused names its keyword: here, the flag the user typed
        message = flag_names(str(exc)) if args.func in (cmd_run, cmd_chat) else str(exc)
        console.print(f"lockstep {args.command}: [red]error:[/red] {escape(message)}")  # as argparse's
        return 2
    except RankError as exc:  # a tensor-parallel rank died or hung: one line, status 1
        console.print(f"lockstep {args.command}: [red]error:[/red] {escape(str(exc))}")
        return 1
    except KeyboardInterrupt:
        console.print("\n[red]interrupted[/red]")
        return 130
    except BrokenPipeError:  # the reader of stdout went away (lockstep run ... | head): stop quietly
        with contextlib.suppress(Exception):  # stdout onto /dev/null, so the last flush cannot raise again
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
