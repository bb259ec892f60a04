"""The `lmcli` command: thin Typer commands that check flags, then call the library.

Every command validates its flags before anything heavy is imported; torch
and the model code load inside the commands, so `lmcli --help` stays fast.
Errors reach the user as one line on stderr (exit 2 for usage, 1 otherwise);
`--debug` shows the traceback instead.
"""

from __future__ import annotations

import contextlib
import enum
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any

import typer
from typer.core import TyperGroup

from lmcli.bench import BenchSettings
from lmcli.errors import LmcliError, TokenizerError, UsageError
from lmcli.settings import DEFAULT_MAX_NEW_TOKENS, DEFAULT_TEMPERATURE

_debug = False  # set by --debug (anywhere on the command line); shows tracebacks


class Device(str, enum.Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class DType(str, enum.Enum):
    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class Quantize(str, enum.Enum):
    none = "none"
    int4 = "int4"
    int8 = "int8"


class OutputFormat(str, enum.Enum):
    text = "text"
    jsonl = "jsonl"


class _LmcliGroup(TyperGroup):
    """Runs the commands with lmcli's error handling, for the console script and CliRunner alike."""

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, windows_expand_args: bool = True, **extra: Any) -> Any:
        global _debug
        args = list(sys.argv[1:] if args is None else args)
        # --debug is accepted anywhere before a `--` so `lmcli generate ... --debug` works too.
        end = args.index("--") if "--" in args else len(args)
        _debug = "--debug" in args[:end]
        args = [a for a in args[:end] if a != "--debug"] + args[end:]
        try:
            code = super().main(args, prog_name or "lmcli", complete_var, standalone_mode=False,
                               windows_expand_args=windows_expand_args, **extra)
        except typer.Abort:
            code = _fail("aborted", 1)
        except LmcliError as e:
            code = _fail(str(e), e.exit_code)
        except Exception as e:
            code = _click_exception_code(e)
            if code is None:  # a bug in lmcli: say so in one line; --debug shows where
                code = _fail(f"internal error: {type(e).__name__}: {e} (rerun with --debug for the traceback)", 1)
        code = code if isinstance(code, int) else 0
        if standalone_mode:
            sys.exit(code)
        return code


def _click_exception_code(e: Exception) -> int | None:
    """The exit code for one of click's exceptions (a usage error, ...), after saying what it is; None
    for anything else. Recognised by click's exception interface (`exit_code`, `format_message`), since
    Typer raises them from its private copy of click and older Typers from click itself."""
    exit_code, format_message = getattr(e, "exit_code", None), getattr(e, "format_message", None)
    if not isinstance(exit_code, int) or format_message is None:
        return None
    if type(e).__name__ == "NoArgsIsHelpError":  # `lmcli` alone: the help, which is no error
        typer.echo(format_message())
        return 0
    message = " ".join(format_message().split())
    context = getattr(e, "ctx", None)  # usage errors know the command they are about
    if context is not None:
        message += f" (see '{context.command_path} --help')"
    return _fail(message, exit_code)


def _fail(message: str, code: int) -> int:
    if _debug and sys.exc_info()[0] is not None:
        traceback.print_exc()
    sys.stderr.write(f"error: {' '.join(message.split())}\n")
    sys.stderr.flush()
    return code


app = typer.Typer(
    name="lmcli",
    cls=_LmcliGroup,
    help="Generate text with open language models (gpt2, llama, mistral, mixtral, qwen2, gemma).",
    epilog="Run 'lmcli COMMAND --help' for a command's options.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        from lmcli import __version__

        typer.echo(f"lmcli {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", metavar="", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
    # Listed here for --help; main() takes --debug out of the arguments wherever it appears.
    debug: Annotated[bool, typer.Option("--debug", metavar="", help="Show tracebacks instead of one-line errors.")] = False,
) -> None:
    """Generate text with open language models (gpt2, llama, mistral, mixtral, qwen2, gemma)."""


# ----------------------------------------------------------------------------- shared options

MODEL_PANEL = "Model"
DECODING_PANEL = "Decoding"
STOPPING_PANEL = "Stopping"
PROMPT_PANEL = "Prompt"
OUTPUT_PANEL = "Output"
JOBS_PANEL = "Batch jobs"

CheckpointOption = Annotated[
    Path | None,
    typer.Option(
        "--checkpoint", "-c", metavar="PATH", exists=True, show_default=False, rich_help_panel=MODEL_PANEL,
        help="An HF directory, a .safetensors file or a .gguf file. Default: the embedded SmolLM2-135M-Instruct.",
    ),
]
ModelOption = Annotated[
    str | None,
    typer.Option(
        "--model", "-m", metavar="NAME", show_default=False, rich_help_panel=MODEL_PANEL,
        help="Architecture or preset name (see 'lmcli models'); optional when the checkpoint has config.json.",
    ),
]
DeviceOption = Annotated[Device, typer.Option("--device", rich_help_panel=MODEL_PANEL, help="Where to run.")]
DTypeOption = Annotated[
    DType, typer.Option("--dtype", rich_help_panel=MODEL_PANEL,
                        help="Activation dtype (auto: float32 on CPU; with quantized weights, the fastest measured here).")
]
QuantizeOption = Annotated[
    Quantize | None,
    typer.Option(
        "--quantize", "-q", show_default=False, rich_help_panel=MODEL_PANEL,
        help="Weights: int4/int8 quantize a float checkpoint at load; none dequantises a GGUF file. "
             "Default: a GGUF file's own quantization, other checkpoints as stored.",
    ),
]


def _load(checkpoint: Path | None, model: str | None, device: Device, dtype: DType, *, need_tokenizer: bool = True,
          quantize: Quantize | None = None):
    """Load the model (with a spinner on a terminal); torch is imported here, not before."""
    from rich.console import Console

    import lmcli

    console = Console(stderr=True)
    where = str(checkpoint) if checkpoint is not None else "the default model"
    with console.status(f"loading {where}…") if console.is_terminal else contextlib.nullcontext():
        loaded, tokenizer = lmcli.load(
            checkpoint=str(checkpoint) if checkpoint is not None else None,
            model=model,
            dtype=dtype.value,
            device=device.value,
            quantize=quantize.value if quantize is not None else None,
        )
    if tokenizer is None and need_tokenizer:
        raise TokenizerError(
            f"{where} has no tokenizer (tokenizer.json, tokenizer.model or GGUF vocabulary), so text cannot be encoded"
        )
    return loaded, tokenizer


# ----------------------------------------------------------------------------- generate


@app.command()
def generate(
    prompt: Annotated[
        str | None,
        typer.Argument(
            metavar="PROMPT", show_default=False,
            help="The prompt. '-' (or no PROMPT with stdin piped) reads all of stdin as the prompt.",
        ),
    ] = None,
    model: ModelOption = None,
    checkpoint: CheckpointOption = None,
    device: DeviceOption = Device.auto,
    dtype: DTypeOption = DType.auto,
    quantize: QuantizeOption = None,
    max_new_tokens: Annotated[
        int, typer.Option("--max-new-tokens", "-n", rich_help_panel=DECODING_PANEL, help="Most tokens to generate.")
    ] = DEFAULT_MAX_NEW_TOKENS,
    temperature: Annotated[
        float | None,
        typer.Option(
            show_default=False, rich_help_panel=DECODING_PANEL,
            help=f"Sampling temperature (default {DEFAULT_TEMPERATURE}); 0 means --greedy.",
        ),
    ] = None,
    top_k: Annotated[
        int | None, typer.Option(show_default=False, rich_help_panel=DECODING_PANEL, help="Sample from the k most likely tokens.")
    ] = None,
    top_p: Annotated[
        float | None,
        typer.Option(show_default=False, rich_help_panel=DECODING_PANEL, help="Nucleus sampling: the smallest set with probability >= p, in (0, 1]."),
    ] = None,
    repetition_penalty: Annotated[
        float | None,
        typer.Option(show_default=False, rich_help_panel=DECODING_PANEL, help="Penalise tokens already present (> 1 discourages repeats)."),
    ] = None,
    greedy: Annotated[
        bool, typer.Option("--greedy", metavar="", rich_help_panel=DECODING_PANEL, help="Always take the most likely token (sampling is the default).")
    ] = False,
    seed: Annotated[
        int | None,
        typer.Option(metavar="INT", show_default=False, rich_help_panel=DECODING_PANEL, help="Random seed, for reproducible sampling (default: drawn at random)."),
    ] = None,
    stop: Annotated[
        list[str] | None,
        typer.Option("--stop", metavar="TEXT", show_default=False, rich_help_panel=STOPPING_PANEL, help="Stop before this text (repeatable); it is not printed."),
    ] = None,
    ignore_eos: Annotated[
        bool, typer.Option("--ignore-eos", metavar="", rich_help_panel=STOPPING_PANEL, help="Keep going past the tokenizer's end-of-text token.")
    ] = False,
    chat: Annotated[
        bool, typer.Option("--chat", metavar="", rich_help_panel=PROMPT_PANEL, help="Wrap the prompt in the checkpoint's chat template, as the user message.")
    ] = False,
    system: Annotated[
        str | None, typer.Option(show_default=False, rich_help_panel=PROMPT_PANEL, help="System message for --chat.")
    ] = None,
    output_format: Annotated[
        OutputFormat | None,
        typer.Option("--format", show_default=False, rich_help_panel=OUTPUT_PANEL, help="text (default) or jsonl: one JSON object per prompt."),
    ] = None,
    logprobs: Annotated[
        int | None,
        typer.Option(
            metavar="K", show_default=False, rich_help_panel=OUTPUT_PANEL,
            help="In JSON output, each token's log-probability and the top K alternatives.",
        ),
    ] = None,
    stats: Annotated[
        bool, typer.Option("--stats", metavar="", rich_help_panel=OUTPUT_PANEL, help="Print tokens, tokens/s and the stop reason on stderr (always shown in a terminal).")
    ] = False,
    input_path: Annotated[
        Path | None,
        typer.Option(
            "--input", metavar="FILE", exists=True, dir_okay=False, show_default=False, rich_help_panel=JOBS_PANEL,
            help="Run a batch job: a .jsonl file (one object with 'prompt' per line) or text (one prompt per line).",
        ),
    ] = None,
    output_path: Annotated[
        Path | None,
        typer.Option("--output", "-o", metavar="FILE", dir_okay=False, show_default=False, rich_help_panel=JOBS_PANEL, help="Write the job's JSONL rows here (default: stdout), with a progress bar."),
    ] = None,
    batch_size: Annotated[
        int | None,
        typer.Option(min=1, show_default=False, rich_help_panel=JOBS_PANEL, help="Rows per batch (default: 8 on CPU, 32 on GPU)."),
    ] = None,
    resume: Annotated[
        bool, typer.Option("--resume", metavar="", rich_help_panel=JOBS_PANEL, help="Finish an interrupted job: keep the rows already in --output, run the rest.")
    ] = False,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", metavar="", rich_help_panel=JOBS_PANEL, help="Replace an existing --output file.")
    ] = False,
) -> None:
    """Generate a completion for PROMPT, or for every row of --input.

    In a terminal the text streams in live after the dimmed prompt; in a pipe
    only the completion is written. Examples:

      lmcli generate --greedy -n 40 "The capital of France is"

      lmcli generate --chat --system "Be brief." "Name three rivers."

      lmcli generate --input prompts.jsonl --output results.jsonl --resume
    """
    from lmcli.settings import GenerationSettings

    _check_job_flags(prompt, input_path, output_path, batch_size, resume, overwrite, output_format)
    if logprobs is not None and input_path is None and output_format != OutputFormat.jsonl:
        raise UsageError("--logprobs goes into JSON output; add --format jsonl")
    settings = GenerationSettings.from_flags(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        greedy=greedy,
        top_k=top_k,
        top_p=top_p,
        repetition_penalty=repetition_penalty,
        seed=seed,
        stop=stop,
        ignore_eos=ignore_eos,
        chat=chat,
        system=system,
        logprobs=logprobs,
    )

    def load():
        return _load(checkpoint, model, device, dtype, quantize=quantize)

    if not sys.stdout.isatty() and hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(encoding="utf-8")  # pipes and files get UTF-8 whatever the locale says

    if input_path is not None:
        _run_job(input_path, output_path, settings, load, batch_size, resume, overwrite, stats)
        return
    text = _read_prompt(prompt)
    _generate_one(text, settings, load, output_format or OutputFormat.text, stats)


def _check_job_flags(prompt, input_path, output_path, batch_size, resume, overwrite, output_format) -> None:
    if input_path is None:
        for flag, value in (("--output", output_path), ("--batch-size", batch_size), ("--resume", resume), ("--overwrite", overwrite)):
            if value:
                raise UsageError(f"{flag} only applies to batch jobs (--input FILE)")
        return
    if prompt is not None:
        raise UsageError("give either a PROMPT or --input FILE, not both")
    if output_format == OutputFormat.text:
        raise UsageError("--input jobs always write JSONL; drop --format text")
    if resume and overwrite:
        raise UsageError("--resume and --overwrite contradict each other; pick one")
    if resume and output_path is None:
        raise UsageError("--resume needs --output FILE (the file to finish)")
    if output_path is not None and output_path.resolve() == input_path.resolve():
        raise UsageError("--output must not be the --input file")


def _read_prompt(prompt: str | None) -> str:
    if prompt is None and sys.stdin.isatty():
        raise UsageError("no prompt: give PROMPT, pipe text on stdin, or use --input FILE")
    if prompt is None or prompt == "-":
        prompt = sys.stdin.read()
    if not prompt:
        raise UsageError("the prompt is empty")
    return prompt


def _generate_one(prompt: str, settings, load, output_format: OutputFormat, stats: bool) -> None:
    import json

    from lmcli.console import PlainOutput, TerminalOutput, print_dim, row_summary
    from lmcli.generation.rows import generate_batch, prepare_row, require_chat_template
    from lmcli.settings import RowError

    model, tokenizer = load()
    if settings.chat:
        require_chat_template(tokenizer)
    try:
        row = prepare_row(tokenizer, 1, prompt, settings)
    except RowError as e:
        raise UsageError(str(e)) from None

    terminal = sys.stdout.isatty()
    if output_format == OutputFormat.jsonl:
        output, on_text = None, None
    else:
        output = TerminalOutput() if terminal else PlainOutput()
        # A chat reply is not a continuation of the prompt's text, so it starts on its own line.
        output.prompt(prompt + "\n" if settings.chat else prompt)

        def on_text(_result, piece: str) -> None:
            output.write(piece)

    try:
        [result] = generate_batch(model, tokenizer, [row], on_text=on_text)
    except KeyboardInterrupt:
        if output is not None:
            output.end()
        sys.stderr.write("interrupted\n")
        raise typer.Exit(130) from None
    except ValueError as e:  # generate() refusing its input, e.g. a prompt longer than the context
        raise LmcliError(" ".join(str(e).split())) from None

    if output is None:
        sys.stdout.write(json.dumps(result.to_json(), ensure_ascii=False) + "\n")
        sys.stdout.flush()
    elif terminal:
        output.end()
    if stats or (terminal and output is not None):
        print_dim(row_summary(result))


def _run_job(input_path, output_path, settings, load, batch_size, resume, overwrite, stats) -> None:
    from lmcli.console import job_summary, print_dim
    from lmcli.jobs import run_job

    try:
        report = run_job(
            input_path, output_path, settings, load=load, batch_size=batch_size, resume=resume, overwrite=overwrite
        )
    except KeyboardInterrupt:
        where = f"; finished rows are saved in {output_path}, rerun with --resume to do the rest" if output_path else ""
        sys.stderr.write(f"interrupted{where}\n")
        raise typer.Exit(130) from None
    if output_path is not None or stats:
        print_dim(job_summary(report, output_path))
    if report.failed:
        raise LmcliError(f"{report.failed} of {report.rows} rows failed; see the \"error\" field of those rows")


# ----------------------------------------------------------------------------- models, info, bench


@app.command()
def models() -> None:
    """List the supported architectures and the model presets (for --model)."""
    from lmcli import registry

    rows = []
    for name in registry.list_presets():
        config = registry.config_from_hf(registry.preset_config(name) or {})
        sizes = (config.num_hidden_layers, config.hidden_size, config.max_position_embeddings)
        rows.append((name, config.architecture, *map(str, sizes)))
    architectures = ", ".join(registry.list_architectures())
    if not sys.stdout.isatty():
        typer.echo(f"architectures\t{architectures}")
        for row in rows:
            typer.echo("\t".join(row))
        return
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(f"[bold]Architectures:[/bold] {architectures}")
    table = Table(title="Presets (--model NAME)", title_justify="left")
    for column in ("preset", "architecture"):
        table.add_column(column)
    for column in ("layers", "hidden", "context"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(*row)
    console.print(table)


@app.command()
def info(
    checkpoint: Annotated[
        Path | None,
        typer.Argument(metavar="CHECKPOINT", exists=True, show_default=False, help="An HF directory, .safetensors or .gguf file (default: the embedded model)."),
    ] = None,
    model: ModelOption = None,
    quantize: QuantizeOption = None,
) -> None:
    """Describe a checkpoint: architecture, size, weight formats, context, tokenizer, what lmcli caches."""
    from lmcli.default_model import describe_weights

    loaded, tokenizer = _load(checkpoint, model, Device.cpu, DType.auto, need_tokenizer=False, quantize=quantize)
    config = loaded.config
    parameters = loaded.num_parameters()
    dtype = str(loaded.dtype).removeprefix("torch.")
    window = config.sliding_window
    facts = [
        ("checkpoint", str(checkpoint)),
        ("architecture", f"{config.architecture} (model_type {config.model_type})"),
        ("parameters", f"{_human(parameters)} ({parameters:,})"),
        ("dtype", dtype),
        ("weights", describe_weights(loaded)),
        ("context length", f"{config.max_position_embeddings:,} tokens"),
        ("sliding window", f"{window:,} tokens" if window else "none"),
        ("layers", str(config.num_hidden_layers)),
        ("hidden size", str(config.hidden_size)),
        ("heads", f"{config.num_attention_heads} (kv {config.num_key_value_heads})"),
        ("vocabulary", f"{config.vocab_size:,}"),
        ("tokenizer", _describe_tokenizer(tokenizer)),
        ("chat template", "yes" if tokenizer is not None and tokenizer.chat_template else "no"),
    ]
    if checkpoint is None:
        from lmcli.default_model import default_checkpoint_path

        checkpoint = Path(default_checkpoint_path())
        facts[0] = ("checkpoint", f"{checkpoint} (the embedded default model)")
    facts.append(("file size", _human_bytes(_size_on_disk(checkpoint))))
    facts.extend(_quantization_facts(checkpoint, loaded))
    if not sys.stdout.isatty():
        for key, value in facts:
            typer.echo(f"{key}: {value}")
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(show_header=False, box=None)
    table.add_column(style="bold", no_wrap=True)
    table.add_column(overflow="fold")  # long paths wrap rather than end in "…"
    for key, value in facts:
        table.add_row(key, value)
    Console().print(table)


def _quantization_facts(checkpoint: Path, loaded) -> list[tuple[str, str]]:
    """The file's own quantization (GGUF), the kernels chosen for it and why, what the cache holds."""
    from lmcli.default_model import describe_cache, gguf_tensor_types

    facts = []
    if checkpoint.suffix == ".gguf":
        facts.append(("file quantization", gguf_tensor_types(checkpoint)))
    for kind, choice in getattr(loaded, "kernel_choices", {}).items():
        facts.append((f"{kind} kernel", choice.describe().split(": ", 1)[1]))
    facts.append(("cache", describe_cache(checkpoint)))
    return facts


@app.command()
def convert(
    gguf_file: Annotated[Path, typer.Argument(metavar="GGUF", exists=True, dir_okay=False, show_default=False,
                                              help="The .gguf file to convert.")],
    out_dir: Annotated[Path, typer.Argument(metavar="OUT_DIR", show_default=False,
                                            help="Where to write config.json, model.safetensors and the tokenizer.")],
    dtype: DTypeOption = DType.auto,
) -> None:
    """Write a GGUF checkpoint as an HF-style directory (dequantised; loads in lmcli and transformers)."""
    if gguf_file.suffix != ".gguf":
        raise typer.BadParameter(f"{gguf_file} is not a .gguf file", param_hint="GGUF")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise UsageError(f"{out_dir}: directory is not empty; choose a new OUT_DIR")
    import torch

    from lmcli.io.gguf import convert_gguf

    torch_dtype = torch.float32 if dtype == DType.auto else getattr(torch, dtype.value)
    written = convert_gguf(gguf_file, out_dir, dtype=torch_dtype)
    files = ", ".join(sorted(p.name for p in written.iterdir()))
    typer.echo(f"wrote {written}: {files}", err=True)


def _describe_tokenizer(tokenizer) -> str:
    if tokenizer is None:
        return "none (text cannot be encoded)"
    parts = [f"{type(tokenizer.backend.model).__name__}, {tokenizer.vocab_size:,} tokens"]
    if tokenizer.add_bos_token:
        parts.append("adds BOS")
    if tokenizer.eos_token_ids:
        parts.append(f"EOS ids {', '.join(map(str, tokenizer.eos_token_ids))}")
    return "; ".join(parts)


def _size_on_disk(path: Path) -> int:
    if path.is_dir():
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return path.stat().st_size


def _human(count: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= size:
            return f"{count / size:.1f}{unit}"
    return str(count)


def _human_bytes(count: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count} bytes"


_BENCH_PANEL = "What to measure"
_BENCH = BenchSettings()  # the defaults, shown in --help


@app.command()
def bench(
    checkpoint: CheckpointOption = None,
    model: ModelOption = None,
    device: DeviceOption = Device.auto,
    dtype: DTypeOption = DType.auto,
    engines: Annotated[str | None, typer.Option(
        metavar="LIST", show_default=False, rich_help_panel=_BENCH_PANEL,
        help="Engines to compare, comma-separated: lmcli, transformers, llama.cpp (when llama-cpp-python is "
             f"importable). Default: {','.join(_BENCH.engines)}.")] = None,
    formats: Annotated[str | None, typer.Option(
        metavar="LIST", show_default=False, rich_help_panel=_BENCH_PANEL,
        help="lmcli weight formats, comma-separated: float (quantize=none, --dtype), native (the GGUF's own "
             f"quantization), int4, int8 (--quantize). Default: {','.join(_BENCH.formats)}.")] = None,
    max_new_tokens: Annotated[int | None, typer.Option(
        "--max-new-tokens", "-n", min=2, show_default=False, rich_help_panel=_BENCH_PANEL,
        help=f"New tokens per decode run. Default: {_BENCH.new_tokens}.")] = None,
    batch_size: Annotated[int | None, typer.Option(
        min=1, show_default=False, rich_help_panel=_BENCH_PANEL,
        help=f"Decode runs at batch 1 and at this batch size. Default: {max(_BENCH.batch_sizes)}.")] = None,
    prompt_tokens: Annotated[int | None, typer.Option(
        min=1, show_default=False, rich_help_panel=_BENCH_PANEL,
        help=f"Prompt length before the decode runs. Default: {_BENCH.prompt_tokens}.")] = None,
    prefill_tokens: Annotated[int | None, typer.Option(
        min=1, show_default=False, rich_help_panel=_BENCH_PANEL,
        help=f"Prompt length of the prefill / time-to-first-token run. Default: {_BENCH.prefill_tokens}.")] = None,
    repeats: Annotated[int | None, typer.Option(
        min=1, show_default=False, rich_help_panel=_BENCH_PANEL,
        help=f"Interleaved rounds; the figures are their medians. Default: {_BENCH.repeats}.")] = None,
    contexts: Annotated[str | None, typer.Option(
        metavar="LIST", show_default=False, rich_help_panel=_BENCH_PANEL,
        help="Contexts for lmcli's decode scaling, comma-separated ('' for none). "
             f"Default: {','.join(map(str, _BENCH.scaling_contexts))}.")] = None,
    scaling_batches: Annotated[str | None, typer.Option(
        metavar="LIST", show_default=False, rich_help_panel=_BENCH_PANEL,
        help="Batch sizes for lmcli's decode scaling, comma-separated ('' for none). "
             f"Default: {','.join(map(str, _BENCH.scaling_batches))}.")] = None,
    skip_quality: Annotated[bool, typer.Option(
        "--no-quality", rich_help_panel=_BENCH_PANEL,
        help="Skip the quality figures (greedy agreement and KL divergence of quantized formats).")] = False,
    quick: Annotated[bool, typer.Option(
        "--quick", rich_help_panel=_BENCH_PANEL,
        help="One round, no 4k context or batch 32, a shorter quality check.")] = False,
    threads: Annotated[int | None, typer.Option(
        min=1, show_default=False, rich_help_panel=_BENCH_PANEL,
        help="Threads per engine. Default: torch's thread count.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the results as JSON instead of tables.")] = False,
) -> None:
    """Benchmark lmcli (each weight format), transformers and llama.cpp on the same weights (see lmcli/bench.py)."""
    from lmcli import bench as bench_module

    options: dict[str, Any] = dict(
        checkpoint=str(checkpoint) if checkpoint is not None else None,
        model=model, device=device.value, dtype=dtype.value, engines=engines, formats=formats,
        max_new_tokens=max_new_tokens, batch_size=batch_size, prompt_tokens=prompt_tokens,
        prefill_tokens=prefill_tokens, repeats=repeats, contexts=contexts, scaling_batches=scaling_batches,
        skip_quality=skip_quality, quick=quick, threads=threads, as_json=as_json,
    )
    # Unset options are left out so bench.py's own defaults apply (and are validated there).
    bench_module.main(**{k: v for k, v in options.items() if v is not None and v is not False})


def main() -> None:
    """The console-script entry point."""
    app()
