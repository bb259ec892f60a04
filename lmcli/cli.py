"""The `lmcli` command: thin Typer commands that check flags, then call the library.

Every command validates its flags before anything heavy is imported; torch
and the model code load inside the commands, so `lmcli --help` stays fast.
Errors reach the user as one line on stderr (exit 2 for usage, 1 otherwise);
`--debug` shows the traceback instead.

One concern, so one file even past ~450 lines: the command line (flags, their help, and commands
that hand over to the library at once). Logic lives in the modules the commands call; what is
shown lives in console.py.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import inspect
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Any

import typer

from lmcli.bench.sections import SECTIONS
from lmcli.bench.settings import BenchSettings  # not lmcli.bench.main: its measuring modules load only for `bench`
from lmcli.command_group import LmcliGroup, defer_collection, resume_collection
from lmcli.errors import TokenizerError, UsageError
from lmcli.generation.constraints import CONSTRAINED_MAX_NEW_TOKENS
from lmcli.resolve.hub import PRESETS as HUB_PRESETS  # huggingface_hub itself loads only for a download
from lmcli.settings.generation_settings import DEFAULT_MAX_NEW_TOKENS, DEFAULT_TEMPERATURE


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


def _one_of(choices: type[enum.Enum]) -> str:
    """A choice flag's metavar, e.g. [auto|cpu|cuda]."""
    return f"[{'|'.join(choice.value for choice in choices)}]"


app = typer.Typer(
    name="lmcli",
    cls=LmcliGroup,
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
    # Listed here for --help; main() takes these out of the arguments wherever they appear (command_group.py).
    debug: Annotated[bool, typer.Option("--debug", metavar="", help="Show tracebacks instead of one-line errors.")] = False,
    fast_kernels: Annotated[bool, typer.Option("--fast-kernels", metavar="", help=(
        "Quantized weights: the kernels measured fastest here, batched attention; a row's text may then "
        "depend on its batch, chunking and machine."))] = False,
    offline: Annotated[bool, typer.Option("--offline", metavar="", help=(
        "Never touch the network: -m and pull use only models on disk (as HF_HUB_OFFLINE=1)."))] = False,
    verbose: Annotated[bool, typer.Option("--verbose", metavar="", help=(
        "Notes about caches: an entry not used, and why."))] = False,
) -> None:
    """Generate text with open language models (gpt2, llama, mistral, mixtral, qwen2, gemma)."""


# ----------------------------------------------------------------------------- shared options

MODEL_PANEL = "Model"
DECODING_PANEL = "Decoding"
STOPPING_PANEL = "Stopping"
PROMPT_PANEL = "Prompt"
OUTPUT_PANEL = "Output"
JOBS_PANEL = "Batch jobs"
STRUCTURED_PANEL = "Structured output (at most one)"


def _option(metavar: str, help: str, *names: str, panel: str | None = DECODING_PANEL, **more: Any) -> Any:
    """An option that is None unless given, so no default is shown (the model's or the command's applies)."""
    return typer.Option(*names, metavar=metavar, show_default=False, rich_help_panel=panel, help=help, **more)


def _switch(name: str, help: str, panel: str | None = None, **more: Any) -> Any:
    """An on/off flag, off unless given; no metavar (Typer's '<bool>' says nothing here)."""
    return typer.Option(name, metavar="", rich_help_panel=panel, help=help, **more)


CheckpointOption = Annotated[Path | None, _option(
    "PATH", "An HF directory, a .safetensors file or a .gguf file. Default: the embedded SmolLM2-135M-Instruct.",
    "--checkpoint", "-c", panel=MODEL_PANEL, exists=True)]
ModelOption = Annotated[str | None, _option(
    "NAME", "Without -c: a model by name, preset or hub REF (ORG/REPO, ORG/REPO:QUANT, ORG/REPO/FILE.gguf, "
            "@REV); one not on this machine is downloaded first (see 'lmcli pull', 'lmcli models'). "
            "With -c: the architecture or preset the checkpoint follows (optional when it has config.json).",
    "--model", "-m", panel=MODEL_PANEL)]
TokenizerOption = Annotated[Path | None, _option(
    "PATH", "A tokenizer.json, tokenizer.model or HF directory to use instead of the checkpoint's own.",
    "--tokenizer", panel=MODEL_PANEL, exists=True)]
DeviceOption = Annotated[Device, typer.Option("--device", metavar=_one_of(Device), rich_help_panel=MODEL_PANEL, help="Where to run.")]
DTypeOption = Annotated[DType, typer.Option(
    "--dtype", metavar=_one_of(DType), rich_help_panel=MODEL_PANEL,
    help="Activation dtype (auto: float32 on CPU; with quantized weights, the fastest measured here).")]
# Speculative decoding (lmcli.generation.speculative_setup): generate and chat.
PromptLookupOption = Annotated[bool, _switch(
    "--prompt-lookup", "Guess tokens from earlier text and verify them in one pass (greedy: the same output; "
    "sampling: the same distribution; faster on text that repeats its input).", OUTPUT_PANEL)]
DraftModelOption = Annotated[str | None, _option(
    "PATH|NAME", "Guess tokens with this smaller model (same tokenizer), verified as --prompt-lookup's.",
    panel=OUTPUT_PANEL)]
DraftQuantizeOption = Annotated[Quantize | None, _option(
    _one_of(Quantize), "Load --draft-model quantized so (as --quantize does the model).", panel=OUTPUT_PANEL)]
NumDraftTokensOption = Annotated[int | None, _option(
    "K", "With --prompt-lookup or --draft-model, guess at most K tokens a pass (default 8).", panel=OUTPUT_PANEL)]
QuantizeOption = Annotated[Quantize | None, _option(
    _one_of(Quantize), "Weights: int4/int8 quantize a float checkpoint at load; none dequantises a GGUF file. "
                       "Default: a GGUF file's own quantization, other checkpoints as stored.",
    "--quantize", "-q", panel=MODEL_PANEL)]
CompileOption = Annotated[bool | None, _switch(
    "--compile/--no-compile", "Run the decode step as a compiled program (CPU: built once per model, machine and "
                 "batch size, a minute or more, then kept in the lmcli cache; CUDA: torch.compile with CUDA graphs). "
                 "Falls back to eager, with a warning, if it fails. Default: a program already built for a quantized "
                 "model runs a single prompt or chat; jobs decode eagerly (LMCLI_COMPILE=0: never, 1: as --compile).",
    MODEL_PANEL, show_default=False)]
ThreadsOption = Annotated[int | None, _option(
    "N", "Threads for torch. Default: chosen for this machine as it is (free CPUs, torchrun ranks; see "
         "'lmcli info'); OMP_NUM_THREADS, OMP_WAIT_POLICY and GOMP_SPINCOUNT, when set, are kept.",
    "--threads", panel=MODEL_PANEL, min=1, max=1024)]
LoraOption = Annotated[list[str] | None, _option(
    "PATH[:SCALE]", "A LoRA adapter: a PEFT directory (adapter_config.json + adapter_model.safetensors) or a GGUF "
                    "LoRA file, its update times SCALE (default 1). Repeatable: the adapters stack; a job row's or "
                    "request's \"lora\": NAME picks one by its directory or file name (\"none\": no adapter).",
    "--lora", panel=MODEL_PANEL)]
StrictOption = Annotated[bool, _switch(
    "--strict", "Refuse a --lora adapter whose adapter_config.json names another base model (default: a warning).",
    MODEL_PANEL)]


PromptCacheOption = Annotated[str | None, _option(
    "DIR|off", "Keep prompts' keys and values between runs in DIR (default: prompts/ in the lmcli cache), or "
               "'off'. Used only where it gives exactly a fresh run's text (quantized weights, the default).",
    "--prompt-cache", panel=MODEL_PANEL)]
PromptCacheSizeOption = Annotated[str | None, _option(
    "SIZE", "Most the prompt cache keeps on disk, e.g. 500M or 4G (default 2G); the least recently used go first.",
    "--prompt-cache-size", panel=MODEL_PANEL)]


def _use_prompt_cache(directory: str | None, size: str | None) -> None:
    """--prompt-cache and --prompt-cache-size, for the library below (io/prompt_blocks.py reads them)."""
    from lmcli.io.sizes import PROMPT_CACHE_ENV, PROMPT_CACHE_SIZE_ENV, parse_size

    if size is not None:
        try:
            parse_size(size)
        except ValueError as e:
            raise UsageError(f"--prompt-cache-size {size}: {e}") from None
        os.environ[PROMPT_CACHE_SIZE_ENV] = size
    if directory is not None:
        if directory.strip() == "":
            raise UsageError("--prompt-cache needs a directory, or 'off'")
        os.environ[PROMPT_CACHE_ENV] = directory


ServerOption = Annotated[str | None, _option(
    "URL", "Talk to a running 'lmcli serve' (e.g. http://127.0.0.1:8000) instead of loading a model; "
           "its key from LMCLI_API_KEY.", "--server", panel=MODEL_PANEL, envvar="LMCLI_SERVER")]


def _refuse_local_flags(flags: dict[str, Any]) -> None:
    """With --server: a flag about the local model is a usage error (the server has its own)."""
    for flag, value in flags.items():
        if value:
            raise UsageError(f"{flag} does not apply with --server (the server has its model and settings)")


def _use_threads(threads: int | None) -> None:
    """Thread settings before torch loads (it loads later, with the model): lmcli.threads."""
    from lmcli.threads import configure

    configure(threads)


# The decoding flags `generate` and `chat` share (a test checks that chat has every one of generate's),
# declared once as the signature of `_decoding_options`; `_with_decoding_options` puts them into a command.
def _decoding_options(
    max_new_tokens: Annotated[int | None, _option(
        "INT", f"Most tokens to generate (default: the model's, else {DEFAULT_MAX_NEW_TOKENS}; "
               f"{CONSTRAINED_MAX_NEW_TOKENS} with a constraint).",
        "--max-new-tokens", "--max-tokens", "-n")] = None,
    temperature: Annotated[float | None, _option(
        "T", f"Sampling temperature (default: the model's, else {DEFAULT_TEMPERATURE}); 0 means --greedy.")] = None,
    top_k: Annotated[int | None, _option("K", "Sample from the k most likely tokens.")] = None,
    top_p: Annotated[float | None, _option("P", "Nucleus sampling: the smallest set with probability >= p, in (0, 1].")] = None,
    min_p: Annotated[float | None, _option("P", "Drop tokens less likely than P times the most likely one, in [0, 1].")] = None,
    typical_p: Annotated[float | None, _option(
        "P", "Locally typical sampling: keep the most typical tokens up to mass P, in (0, 1].")] = None,
    repetition_penalty: Annotated[float | None, _option("X", "Penalise tokens already present (> 1 discourages repeats).")] = None,
    presence_penalty: Annotated[float | None, _option(
        "X", "Subtract this from the logit of every token already generated, in [-2, 2].")] = None,
    frequency_penalty: Annotated[float | None, _option(
        "X", "Subtract this times the count of each token already generated, in [-2, 2].")] = None,
    no_repeat_ngram_size: Annotated[int | None, _option("N", "Never repeat an N-token sequence already in the text.")] = None,
    num_beams: Annotated[int | None, _option(
        "N", "Beam search with N beams, as transformers' (default: the model's, else 1: none). Not with sampling "
             "flags, speculation or structured output.")] = None,
    length_penalty: Annotated[float | None, _option(
        "X", "Beam search: a finished beam's score is its log-probability / length**X (default: the model's, else 1).")] = None,
    early_stopping: Annotated[str | None, _option(
        "WHEN", "Beam search: true (stop once N beams are finished), false (when none can improve; the default) "
                "or never.")] = None,
    logit_bias: Annotated[list[str] | None, _option(
        "TOKEN=BIAS", "Add BIAS (-100 to 100) to a token's logit; TOKEN is an id or text that is one token (repeatable).",
        "--logit-bias")] = None,
    greedy: Annotated[bool, _switch(
        "--greedy", "Always take the most likely token (sampling is the default).", DECODING_PANEL)] = False,
    seed: Annotated[int | None, _option("INT", "Random seed, for reproducible sampling (default: drawn at random).")] = None,
    stop: Annotated[list[str] | None, _option(
        "TEXT", "Stop before this text (repeatable); it is not printed. '\\n' is a newline, '\\\\' a backslash.",
        "--stop", panel=STOPPING_PANEL)] = None,
    min_new_tokens: Annotated[int | None, _option(
        "INT", "Do not stop at the end-of-text token before this many tokens.", panel=STOPPING_PANEL)] = None,
    ignore_eos: Annotated[bool, _switch(
        "--ignore-eos", "Keep going past the tokenizer's end-of-text token.", STOPPING_PANEL)] = False,
    json_schema: Annotated[str | None, _option(
        "FILE|JSON", "The output is JSON that fits this JSON Schema (a file, or inline JSON).",
        "--json-schema", panel=STRUCTURED_PANEL)] = None,
    json_object: Annotated[bool, _switch("--json", "The output is a JSON object (any).", STRUCTURED_PANEL)] = False,
    regex: Annotated[str | None, _option(
        "PATTERN", "The output matches this regular expression, whole.", "--regex", panel=STRUCTURED_PANEL)] = None,
    grammar: Annotated[Path | None, _option(
        "FILE", "The output follows this Lark grammar (llguidance's dialect).", "--grammar",
        panel=STRUCTURED_PANEL)] = None,
) -> None:
    """Never called: its parameters are the shared decoding flags, in the order --help lists them."""


DecodingFlags = dict[str, Any]  # the shared decoding flags' values, by parameter name


def _with_decoding_options(command: Callable[..., None]) -> Callable[..., None]:
    """`command` as Typer should see it: its keyword-only `decoding: DecodingFlags` parameter replaced, in
    place, by the flags of `_decoding_options`; their values reach `command` as that one dict."""
    shared = inspect.signature(_decoding_options, eval_str=True).parameters
    own = inspect.signature(command, eval_str=True)
    parameters: list[inspect.Parameter] = []
    for parameter in own.parameters.values():
        if parameter.name == "decoding":
            parameters += [flag.replace(kind=inspect.Parameter.KEYWORD_ONLY) for flag in shared.values()]
        else:
            parameters.append(parameter)

    @functools.wraps(command)
    def with_decoding_flags(**values: Any) -> None:
        decoding = {name: values.pop(name) for name in shared}
        command(**values, decoding=decoding)

    with_decoding_flags.__signature__ = own.replace(parameters=parameters)  # type: ignore[attr-defined]
    with_decoding_flags.__annotations__ = {parameter.name: parameter.annotation for parameter in parameters}
    return with_decoding_flags


ColorProbsOption = Annotated[bool, _switch(
    "--color-probs", "In a terminal, colour each token by the probability the model gave it (red: unlikely).",
    OUTPUT_PANEL)]


def _settings_from_flags(decoding: DecodingFlags, **others: Any):
    """GenerationSettings from a command's decoding flags and `others`."""
    from lmcli.jobs.input import unescape_line
    from lmcli.settings.generation_settings import GenerationSettings, parse_logit_bias

    flags = dict(decoding)
    logit_bias, stop = flags.pop("logit_bias"), flags.pop("stop")
    constraint = _constraint_from_flags(flags)  # pops its four flags
    if flags.get("early_stopping") is not None:
        words = {"true": True, "false": False, "never": "never"}
        if flags["early_stopping"].lower() not in words:
            raise UsageError(f"--early-stopping must be true, false or never, got {flags['early_stopping']!r}")
        flags["early_stopping"] = words[flags["early_stopping"].lower()]
    return GenerationSettings.from_flags(
        **flags, constraint=constraint,
        logit_bias=parse_logit_bias(logit_bias),
        stop=[unescape_line(text) for text in stop or ()],  # '\n' is a newline, as in text input files
        **others,
    )


def _constraint_from_flags(flags: DecodingFlags):
    """The one constraint --json-schema/--json/--regex/--grammar give (popped from `flags`), or None;
    a bad one is a usage error now, before any model loads."""
    from lmcli.generation.constraints import FLAGS, one_constraint, read_source

    given = {"json_schema": flags.pop("json_schema"), "json": flags.pop("json_object"),
             "regex": flags.pop("regex"), "grammar": flags.pop("grammar")}
    if given["grammar"] is not None:
        given["grammar"] = str(given["grammar"])
    def name(kind: str) -> str:  # a file's error names the file
        return f"--grammar {given['grammar']}" if kind == "grammar" else FLAGS[kind]

    return one_constraint({kind: read_source(kind, value) if isinstance(value, str) else value
                           for kind, value in given.items()}, name)


def _resolve(checkpoint: Path | None, model: str | None, tokenizer: Path | None = None):
    """The model -c/-m/--tokenizer name, resolved once for the whole command (lmcli.resolve.model_ref)."""
    from lmcli.resolve.model_ref import resolve_model

    return resolve_model(checkpoint, model, tokenizer)


def _load(resolved, device: Device, dtype: DType, *, need_tokenizer: bool = True, tp: int | None = None,
          quantize: Quantize | None = None, compile_decode: bool | None = False, job: bool = False,
          lora: Sequence[str] | None = None, strict: bool = False):
    """Load the resolved model (with a spinner on a terminal); torch is imported here, not before.
    `lora`: adapters to put on it (kernels/lora.py), merged into float weights unless a job's or
    server's rows may pick among them (`job`)."""
    import lmcli

    where = str(resolved.path)
    with _spinner(f"loading {where}…"):
        loaded, text_tokenizer = lmcli.load(
            resolved, dtype=dtype.value, device=device.value, tp=tp,
            quantize=quantize.value if quantize is not None else None,
        )
        if lora:
            from lmcli.kernels import lora as adapters

            if tp is not None and tp > 1:
                raise UsageError(f"--lora with --tp {tp}: adapters on tensor-parallel models are not supported")
            if getattr(loaded.config, "is_encoder_decoder", False):
                raise UsageError("--lora: adapters on encoder-decoder models are not supported")
            names = [str(resolved.path), resolved.name or "", str(getattr(loaded.config, "name_or_path", "") or "")]
            adapters.attach(loaded, lora, merge=not job, strict=strict, model_names=names)
    resume_collection()
    from lmcli.models.compiled_step import compile_mode

    mode = compile_mode(compile_decode, job)
    if mode == "build":
        loaded.compile_decode()
    elif mode == "cached":
        loaded.compile_decode(builds=False)
    if text_tokenizer is None and need_tokenizer:
        raise TokenizerError(
            f"{where} has no tokenizer (tokenizer.json, tokenizer.model or GGUF vocabulary), so text cannot be"
            " encoded; give one with --tokenizer PATH"
        )
    return loaded, text_tokenizer


# ----------------------------------------------------------------------------- generate


@app.command()
@_with_decoding_options
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
    tokenizer: TokenizerOption = None,
    device: DeviceOption = Device.auto,
    dtype: DTypeOption = DType.auto,
    quantize: QuantizeOption = None,
    compile_decode: CompileOption = None,
    threads: ThreadsOption = None,
    prompt_cache: PromptCacheOption = None,
    prompt_cache_size: PromptCacheSizeOption = None,
    *,
    decoding: DecodingFlags,
    chat: Annotated[bool, _switch(
        "--chat", "Wrap the prompt in the checkpoint's chat template, as the user message.", PROMPT_PANEL)] = False,
    system: Annotated[str | None, _option("TEXT", "System message for --chat.", panel=PROMPT_PANEL)] = None,
    no_truncate: Annotated[bool, _switch(
        "--no-truncate", "Refuse a prompt longer than the model's context (default: drop its start, with a warning).",
        PROMPT_PANEL)] = False,
    output_format: Annotated[OutputFormat | None, _option(
        _one_of(OutputFormat), "text (default) or jsonl: one JSON object per prompt.", "--format", panel=OUTPUT_PANEL)] = None,
    logprobs: Annotated[int | None, _option(
        "K", "In JSON output, each token's log-probability and the top K alternatives.", panel=OUTPUT_PANEL)] = None,
    stats: Annotated[bool, _switch(
        "--stats", "Print tokens, tokens/s and the stop reason on stderr (always shown in a terminal).",
        OUTPUT_PANEL)] = False,
    color_probs: ColorProbsOption = False,
    prompt_lookup: PromptLookupOption = False,
    draft_model: DraftModelOption = None,
    draft_quantize: DraftQuantizeOption = None,
    num_draft_tokens: NumDraftTokensOption = None,
    input_path: Annotated[Path | None, _option(
        "FILE", "Run a batch job: a .jsonl file (one object with 'prompt' per line) or text (one prompt per line).",
        "--input", panel=JOBS_PANEL, exists=True, dir_okay=False)] = None,
    output_path: Annotated[Path | None, _option(
        "FILE", "Write the job's JSONL rows here (default: stdout), with a progress bar.",
        "--output", "-o", panel=JOBS_PANEL, dir_okay=False)] = None,
    batch_size: Annotated[int | None, _option(
        "INT", "Rows per batch (default: 8 on CPU, 32 on GPU).", panel=JOBS_PANEL, min=1)] = None,
    resume: Annotated[bool, _switch(
        "--resume", "Finish an interrupted job: keep the rows already in --output, run the rest.", JOBS_PANEL)] = False,
    overwrite: Annotated[bool, _switch("--overwrite", "Replace an existing --output file.", JOBS_PANEL)] = False,
    tp: Annotated[int | None, _option(
        "N", "Tensor parallel over N processes: run under 'torchrun --nproc-per-node N -m lmcli generate --tp N ...'.",
        "--tp", panel=MODEL_PANEL, min=1)] = None,
    server: ServerOption = None,
    lora: LoraOption = None,
    strict: StrictOption = False,
) -> None:
    """Generate a completion for PROMPT, or for every row of --input.

    In a terminal the text streams in live after the dimmed prompt; in a pipe
    only the completion is written. Examples:

      lmcli generate --greedy -n 40 "The capital of France is"

      lmcli generate --chat --system "Be brief." "Name three rivers."

      lmcli generate --input prompts.jsonl --output results.jsonl --resume
    """
    if server:
        local = {"--format": output_format == OutputFormat.jsonl and input_path is None,
                 "--logprobs": logprobs is not None and input_path is None,
                 "--color-probs": color_probs, "--prompt-lookup": prompt_lookup, "--draft-model": draft_model,
                 "--tp": tp, "--model": model, "--checkpoint": checkpoint, "--tokenizer": tokenizer,
                 "--quantize": quantize, "--no-truncate": no_truncate, "--prompt-cache": prompt_cache,
                 "--prompt-cache-size": prompt_cache_size, "--lora": lora}
        from lmcli.jobs import runs
        from lmcli.serve import client

        _refuse_local_flags(local)
        if input_path is not None:
            _check_job_flags(prompt, input_path, output_path, None, resume, overwrite, output_format)
            _run_remote_job(server, input_path, output_path, batch_size, resume, overwrite, stats,
                            _settings_from_flags(decoding, chat=chat, system=system, logprobs=logprobs))
            return
        client.generate(server, runs.read_prompt(prompt), decoding, chat=chat, system=system, stats=stats)
        return
    _use_threads(threads)
    _use_prompt_cache(prompt_cache, prompt_cache_size)
    _check_job_flags(prompt, input_path, output_path, batch_size, resume, overwrite, output_format)
    if logprobs is not None and input_path is None and output_format != OutputFormat.jsonl:
        raise UsageError("--logprobs goes into JSON output; add --format jsonl")
    import lmcli
    from lmcli.generation import speculative_setup as speculation
    from lmcli.jobs import runs

    speculate = speculation.from_flags(prompt_lookup, draft_model, num_draft_tokens,
                                       draft_quantize.value if draft_quantize is not None else None)
    settings = _settings_from_flags(decoding, chat=chat, system=system, logprobs=logprobs, truncate=not no_truncate,
                                    prompt_lookup=prompt_lookup, draft_model=draft_model is not None,
                                    num_draft_tokens=num_draft_tokens)  # a job's rows may choose otherwise
    resolved = _resolve(checkpoint, model, tokenizer)
    # The model's own sampling defaults fill what no flag set (read from its files, not loaded).
    settings = settings.with_model_defaults(resolved.defaults)

    def load():
        loaded, loaded_tokenizer = _load(resolved, device, dtype, tp=tp, quantize=quantize,
                                         compile_decode=compile_decode, job=input_path is not None, lora=lora,
                                         strict=strict)
        if settings.logit_bias:  # a bad --logit-bias token stops the run here, before any row
            settings.logit_bias_ids(loaded_tokenizer, loaded.config.vocab_size)
        return speculation.wrap_loaded(speculate, (loaded, loaded_tokenizer), resolved, lmcli.load)

    if not sys.stdout.isatty() and hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(encoding="utf-8")  # pipes and files get UTF-8 whatever the locale says

    with _process_group(tp, input_path, device):
        if input_path is not None:
            with _exit_when_stopped():
                try:
                    runs.run_job(input_path, output_path, settings, load, batch_size, resume, overwrite, stats,
                                 resolved.identity, tp)
                finally:  # before a failed row's error line
                    runs.speculation_summary(stats)
            return
        text = runs.read_prompt(prompt)
        with _exit_when_stopped():
            runs.generate_one(text, settings, load, output_format == OutputFormat.jsonl, stats, color_probs)
            runs.speculation_summary(stats or sys.stdout.isatty())


def _run_remote_job(server: str, input_path: Path, output_path: Path | None, concurrency: int | None, resume: bool,
                    overwrite: bool, stats: bool, settings: Any) -> None:
    """`generate --input FILE --server URL`: the job's rows as requests, --batch-size of them at once."""
    from lmcli.jobs import runs
    from lmcli.serve import client, remote_job

    api_key = os.environ.get(client.API_KEY_ENV)
    own = remote_job.server_model(server, api_key)
    settings = settings.with_model_defaults(remote_job.model_defaults(own))  # the served model's, as local
    job = remote_job.remote_job(server, api_key, concurrency or 8, own["model"])
    if not sys.stdout.isatty() and hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(encoding="utf-8")
    with _exit_when_stopped():
        runs.run_job(input_path, output_path, settings, None, None, resume, overwrite, stats, lambda: own["model"],
                     job=job)


def _spinner(text: str) -> Any:
    """rich's status line on a terminal's stderr; nothing elsewhere (rich is not even imported then)."""
    if not (sys.stderr.isatty() or "FORCE_TERMINAL" in os.environ or "TTY_INTERACTIVE" in os.environ):
        return contextlib.nullcontext()
    from rich.console import Console

    console = Console(stderr=True)
    return console.status(text) if console.is_terminal else contextlib.nullcontext()


@contextlib.contextmanager
def _exit_when_stopped():
    """A run that ended early has said why (lmcli.jobs.runs): exit with its code (130 for Ctrl-C, as a shell expects)."""
    from lmcli.jobs.runs import Stopped

    try:
        yield
    except Stopped as stopped:
        raise typer.Exit(stopped.code) from None


@contextlib.contextmanager
def _process_group(tp: int | None, input_path: Path | None, device: Device):
    """Under torchrun: join the process group for the run; only rank 0 writes to stdout."""
    from lmcli import distributed

    if not distributed.launched_by_torchrun():
        distributed.check_world(tp)  # --tp without torchrun
        yield
        return
    data_parallel = tp is None and input_path is not None
    distributed.start(device.value, distributed.JOB_TIMEOUT if data_parallel else None)
    try:
        distributed.check_world(tp)
        if tp is None and input_path is None and distributed.world_size() > 1:
            raise UsageError(f"torchrun started {distributed.world_size()} processes: add --tp "
                             f"{distributed.world_size()} (tensor parallel) or --input FILE (a data-parallel job)")
        if not distributed.is_output_rank():
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the process
        yield
    finally:
        distributed.finish()


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


# ----------------------------------------------------------------------------- chat


@app.command()
@_with_decoding_options
def chat(
    ctx: typer.Context,
    model: ModelOption = None,
    checkpoint: CheckpointOption = None,
    device: DeviceOption = Device.auto,
    dtype: DTypeOption = DType.auto,
    quantize: QuantizeOption = None,
    compile_decode: CompileOption = None,
    threads: ThreadsOption = None,
    prompt_cache: PromptCacheOption = None,
    prompt_cache_size: PromptCacheSizeOption = None,
    *,
    decoding: DecodingFlags,
    system: Annotated[str | None, _option("TEXT", "The system message.", panel=PROMPT_PANEL)] = None,
    context: Annotated[int | None, _option(
        "TOKENS", "Most tokens the conversation keeps before its oldest turns are dropped"
                  " (default: the model's context, at most 4096).", panel=PROMPT_PANEL, min=2)] = None,
    resume: Annotated[Path | None, _option(
        "FILE", "Continue a transcript saved with /save (its settings too, unless given as flags).",
        "--resume", panel=PROMPT_PANEL, exists=True, dir_okay=False)] = None,
    markdown: Annotated[bool, _switch(
        "--markdown", "In a terminal, show each finished reply rendered as Markdown.", OUTPUT_PANEL)] = False,
    color_probs: ColorProbsOption = False,
    stats: Annotated[bool, _switch(
        "--stats", "After each reply, print tokens, tokens/s and the prefill count on stderr.", OUTPUT_PANEL)] = False,
    prompt_lookup: PromptLookupOption = False,
    draft_model: DraftModelOption = None,
    draft_quantize: DraftQuantizeOption = None,
    num_draft_tokens: NumDraftTokensOption = None,
    server: ServerOption = None,
    lora: LoraOption = None,
    strict: StrictOption = False,
) -> None:
    """Talk with the model: a conversation over the checkpoint's chat template.

    The conversation stays in the model's cache, so each turn processes only its new
    tokens. Type /help for the commands. With stdin not a terminal, each line is a
    message and only the replies are written, one after another:

      printf 'Hi\\nAnd again?\\n' | lmcli chat --greedy
    """
    from lmcli.chat.repl import ChatOptions

    options = ChatOptions(
        markdown=markdown, color_probs=color_probs, stats=stats, context=context, resume=resume,
        explicit=frozenset(_explicit_settings(ctx)),
    )
    if server:
        _refuse_local_flags({"--model": model, "--checkpoint": checkpoint, "--quantize": quantize,
                             "--device": device != Device.auto, "--dtype": dtype != DType.auto,
                             "--compile": compile_decode, "--threads": threads, "--color-probs": color_probs,
                             "--prompt-lookup": prompt_lookup, "--draft-model": draft_model,
                             "--prompt-cache": prompt_cache, "--prompt-cache-size": prompt_cache_size,
                             "--lora": lora})
        from lmcli.serve import client
        from lmcli.serve.remote_chat import run_remote_chat

        body = client.request_body("", decoding, True, None)  # the flags no request field carries are refused
        try:
            run_remote_chat(server, body, _settings_from_flags(decoding, chat=True, system=system), options)
        except KeyboardInterrupt:
            sys.stderr.write("\ninterrupted\n")
            raise typer.Exit(130) from None
        return
    import lmcli
    from lmcli.chat.repl import run_chat
    from lmcli.generation import speculative_setup as speculation

    _use_threads(threads)
    _use_prompt_cache(prompt_cache, prompt_cache_size)
    speculate = speculation.from_flags(prompt_lookup, draft_model, num_draft_tokens,
                                       draft_quantize.value if draft_quantize is not None else None)
    settings = _settings_from_flags(decoding, chat=True, system=system)
    resolved = _resolve(checkpoint, model)
    settings = settings.with_model_defaults(resolved.defaults)
    try:
        run_chat(lambda: speculation.wrap_loaded(
            speculate, _load(resolved, device, dtype, quantize=quantize, compile_decode=compile_decode, lora=lora,
                             strict=strict), resolved,
            lmcli.load),
                 settings, options, resolved)
    except KeyboardInterrupt:  # in a pipe, or while loading (a reply in a terminal stops on its own)
        sys.stderr.write("\ninterrupted\n")
        raise typer.Exit(130) from None


def _explicit_settings(ctx: typer.Context) -> set[str]:
    """The settings given on this command line (they win over those of a resumed transcript)."""
    # By name: typer may bring its own copy of click, whose ParameterSource is another class.
    given = {name for name in ctx.params if getattr(ctx.get_parameter_source(name), "name", "") == "COMMANDLINE"}
    return {"temperature" if name == "greedy" else name for name in given}


# ----------------------------------------------------------------------------- serve


class LogFormat(str, enum.Enum):
    text = "text"
    json = "json"


SERVE_PANEL = "Server"


@app.command()
def serve(
    model: ModelOption = None,
    checkpoint: CheckpointOption = None,
    tokenizer: TokenizerOption = None,
    device: DeviceOption = Device.auto,
    dtype: DTypeOption = DType.auto,
    quantize: QuantizeOption = None,
    threads: ThreadsOption = None,
    prompt_cache: PromptCacheOption = None,
    prompt_cache_size: PromptCacheSizeOption = None,
    host: Annotated[str, typer.Option("--host", metavar="HOST", rich_help_panel=SERVE_PANEL,
                                      help="Address to listen on (another than localhost warns without --api-key).")
                    ] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", metavar="PORT", rich_help_panel=SERVE_PANEL, min=0, max=65535,
                                      help="Port to listen on (0: any free one, printed at start).")] = 8000,
    api_key: Annotated[str | None, _option(
        "KEY", "Require 'Authorization: Bearer KEY' on /v1 (401 otherwise).", "--api-key", panel=SERVE_PANEL,
        envvar="LMCLI_API_KEY")] = None,
    batch_size: Annotated[int | None, _option(
        "INT", "Requests (rows) decoded together (default: 8 on CPU, 32 on GPU).", "--batch-size",
        "--max-concurrency", panel=SERVE_PANEL, min=1)] = None,
    max_queue: Annotated[int, typer.Option("--max-queue", metavar="INT", rich_help_panel=SERVE_PANEL, min=0,
                                           help="Rows waiting for a place at most; a request past it gets 429.")] = 64,
    context: Annotated[int | None, _option(
        "TOKENS", "Longest request, prompt and max_tokens together (default: the model's context, at most 2048).",
        "--context", panel=SERVE_PANEL, min=2)] = None,
    max_body: Annotated[int, typer.Option("--max-body", metavar="BYTES", rich_help_panel=SERVE_PANEL, min=1,
                                          help="Largest request body (413 past it).")] = 1 << 20,
    request_timeout: Annotated[float, typer.Option(
        "--request-timeout", metavar="SECONDS", rich_help_panel=SERVE_PANEL, min=0.001,
        help="A request still running after this long is ended (504).")] = 600.0,
    shutdown_timeout: Annotated[float, typer.Option(
        "--shutdown-timeout", metavar="SECONDS", rich_help_panel=SERVE_PANEL, min=0,
        help="On SIGTERM, how long requests in flight may take to finish before they are cancelled.")] = 10.0,
    log_format: Annotated[LogFormat, typer.Option("--log-format", metavar=_one_of(LogFormat),
                                                  rich_help_panel=SERVE_PANEL,
                                                  help="One line per request: key=value text, or JSON.")
                          ] = LogFormat.text,
    lora: LoraOption = None,
    strict: StrictOption = False,
) -> None:
    """Serve the model over HTTP with OpenAI's API (/v1/chat/completions, /v1/completions, /v1/models, /health).

    Requests run side by side in one continuous batch, each with the tokens it gets alone:

      lmcli serve --port 8000

      curl http://127.0.0.1:8000/v1/completions -d '{"prompt": "The sky is", "max_tokens": 16}'
    """
    _use_threads(threads)
    _use_prompt_cache(prompt_cache, prompt_cache_size)
    from lmcli.serve.server import ServeOptions, served_defaults
    from lmcli.serve.server import serve as run_server

    resolved = _resolve(checkpoint, model, tokenizer)
    from lmcli.settings.generation_settings import GenerationSettings

    base = GenerationSettings().with_model_defaults(served_defaults(resolved.defaults))  # no beams: a note says so

    def load():
        return _load(resolved, device, dtype, quantize=quantize, compile_decode=False, job=True, lora=lora,
                     strict=strict)

    options = ServeOptions(host=host, port=port, api_key=api_key, batch_size=batch_size, max_queue=max_queue,
                           context=context, max_body=max_body, request_timeout=request_timeout,
                           shutdown_timeout=shutdown_timeout, log_format=log_format.value)
    run_server(options, load, resolved.identity, base)


# ----------------------------------------------------------------------------- models, info, bench


@app.command()
def models() -> None:
    """List the real models on this machine (for --model NAME), then the architectures and presets."""
    from lmcli.console import print_models

    print_models(terminal=sys.stdout.isatty())


@app.command()
def pull(
    name: Annotated[str, typer.Argument(metavar="REF", show_default=False, help=(
        "ORG/REPO (an HF directory: config, tokenizer, safetensors), ORG/REPO:QUANT (one GGUF file, e.g. "
        f"Q4_K_M), ORG/REPO/FILE.gguf, a name ({', '.join(HUB_PRESETS)}; see 'lmcli models'), or a "
        "packaged model (smollm2-135m, gemma-3-270m)."))],
    revision: Annotated[str | None, _option(
        "REV", "A branch, tag or commit of the hub repo (default: main).", "--revision", panel=None)] = None,
) -> None:
    """Download a model from the HuggingFace Hub (HF_ENDPOINT, HF_TOKEN) into its cache, and print its path."""
    from lmcli.resolve import hub

    typer.echo(str(hub.pull(name, revision)))


@app.command()
def rm(
    name: Annotated[str, typer.Argument(metavar="REF", show_default=False, help=(
        "A pulled model: ORG/REPO[@REV] (every file of it) or ORG/REPO:QUANT, ORG/REPO/FILE.gguf (that file)."))],
) -> None:
    """Remove a pulled model from the HuggingFace cache (huggingface_hub's cache management)."""
    from lmcli.resolve import hub

    typer.echo(hub.remove(name))


@app.command()
def info(
    path: Annotated[Path | None, typer.Argument(
        metavar="[CHECKPOINT]", exists=True, show_default=False,
        help="The checkpoint, as -c gives it (default: the embedded model).")] = None,
    checkpoint: CheckpointOption = None,
    model: ModelOption = None,
    tokenizer: TokenizerOption = None,
    quantize: QuantizeOption = None,
    lora: LoraOption = None,
    strict: StrictOption = False,
) -> None:
    """Describe a checkpoint: architecture, size, weight formats, context, tokenizer, what lmcli caches;
    with --lora, what each adapter targets and its size (checked against the model)."""
    _use_threads(None)  # before anything below loads torch
    from lmcli.console import checkpoint_facts, print_facts

    if path is not None and checkpoint is not None and path != checkpoint:
        raise UsageError(f"info {path} -c {checkpoint}: give the checkpoint once")
    resolved = _resolve(checkpoint or path, model, tokenizer)
    loaded, text_tokenizer = _load(resolved, Device.cpu, DType.auto, need_tokenizer=False, quantize=quantize,
                                   lora=lora, strict=strict, job=True)
    from lmcli.models import native_attention
    from lmcli.threads import describe

    attention = native_attention.describe() if getattr(loaded, "batch_invariant", False) else "torch, batched"
    facts = [*checkpoint_facts(resolved, loaded, text_tokenizer), ("threads", describe()), ("attention", attention)]
    if lora:
        from lmcli.kernels import lora as adapters

        for adapter in adapters.loaded(loaded).files:  # type: ignore[union-attr]
            facts.extend(adapters.describe(adapter))
    print_facts(facts, terminal=sys.stdout.isatty())


@app.command()
def cache(
    action: Annotated[str | None, typer.Argument(
        metavar="[clear]", show_default=False, help="clear: empty the caches (all, or those the flags name).")] = None,
    prompts: Annotated[bool, _switch("--prompts", "Only the prompt cache's blocks.")] = False,
    packed: Annotated[bool, _switch("--packed", "Only the packed weights.")] = False,
    compiled: Annotated[bool, _switch("--compiled", "Only the compiled programs.")] = False,
    prompt_cache: PromptCacheOption = None,
) -> None:
    """Show the caches lmcli keeps (packed weights, compiled programs, prompt blocks) and their sizes;
    'lmcli cache clear' empties them."""
    from lmcli.io import cache_dirs
    from lmcli.io.sizes import human_bytes

    if action not in (None, "clear"):
        raise UsageError(f"cache {action}: unknown action (only 'clear')")
    if action is None and (prompts or packed or compiled):
        raise UsageError("--prompts, --packed and --compiled choose what 'lmcli cache clear' empties")
    _use_prompt_cache(prompt_cache, None)
    chosen = [kind for kind, on in (("prompts", prompts), ("packed", packed), ("compiled", compiled)) if on]
    for kind in chosen or list(cache_dirs.KINDS):
        use = cache_dirs.clear(kind) if action == "clear" else cache_dirs.usage(kind)
        what = cache_dirs.WHAT[kind]
        if use.directory is None:
            typer.echo(f"{what}: off")
        elif action == "clear":
            typer.echo(f"{what}: removed {_files(use.files)}, {human_bytes(use.bytes)} ({use.directory})")
        else:
            typer.echo(f"{what}: {_files(use.files)}, {human_bytes(use.bytes)} ({use.directory})")


def _files(count: int) -> str:
    return f"{count} file" if count == 1 else f"{count} files"


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
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise UsageError(f"{out_dir}: directory is not empty; choose a new OUT_DIR")
    import torch

    from lmcli.io.gguf import convert_gguf

    torch_dtype = torch.float32 if dtype == DType.auto else getattr(torch, dtype.value)
    written = convert_gguf(gguf_file, out_dir, dtype=torch_dtype)
    files = ", ".join(sorted(p.name for p in written.iterdir()))
    typer.echo(f"wrote {written}: {files}", err=True)


_BENCH_PANEL = "What to measure"
_BENCH = BenchSettings()  # the defaults, shown in --help
_BENCH_SECTIONS = tuple(SECTIONS)
_measure = functools.partial(_option, panel=_BENCH_PANEL)


def _listed(values: Sequence[object]) -> str:
    """A list's default as the LIST flags take it: comma-separated."""
    return ",".join(map(str, values))


@app.command()
def bench(
    checkpoint: CheckpointOption = None,
    model: ModelOption = None,
    device: DeviceOption = Device.auto,
    dtype: DTypeOption = DType.auto,
    engines: Annotated[str | None, _measure(
        "LIST", "Engines to compare, comma-separated: lmcli, transformers, llama.cpp (when llama-cpp-python is "
                f"importable). Default: {_listed(_BENCH.engines)}.")] = None,
    formats: Annotated[str | None, _measure(
        "LIST", "lmcli weight formats, comma-separated: float (quantize=none, --dtype), native (the GGUF's own "
                f"quantization), int4, int8 (--quantize). Default: {_listed(_BENCH.formats)}.")] = None,
    max_new_tokens: Annotated[int | None, _measure(
        "INT", f"New tokens per decode run. Default: {_BENCH.new_tokens}.", "--max-new-tokens", "-n", min=2)] = None,
    batch_size: Annotated[int | None, _measure(
        "INT", f"Decode runs at batch 1 and at this batch size. Default: {max(_BENCH.batch_sizes)}.", min=1)] = None,
    prompt_tokens: Annotated[int | None, _measure(
        "INT", f"Prompt length before the decode runs. Default: {_BENCH.prompt_tokens}.", min=1)] = None,
    prefill_tokens: Annotated[int | None, _measure(
        "INT", f"Prompt length of the prefill / time-to-first-token run. Default: {_BENCH.prefill_tokens}.",
        min=1)] = None,
    repeats: Annotated[int | None, _measure(
        "INT", f"Interleaved rounds; the figures are their medians. Default: {_BENCH.repeats}.", min=1)] = None,
    contexts: Annotated[str | None, _measure(
        "LIST", "Contexts for lmcli's decode scaling, comma-separated ('' for none). "
                f"Default: {_listed(_BENCH.scaling_contexts)}.")] = None,
    scaling_batches: Annotated[str | None, _measure(
        "LIST", "Batch sizes for lmcli's decode scaling, comma-separated ('' for none). "
                f"Default: {_listed(_BENCH.scaling_batches)}.")] = None,
    skip_quality: Annotated[bool, _switch(
        "--no-quality", "Skip the quality figures (greedy agreement and KL divergence of quantized formats).",
        _BENCH_PANEL)] = False,
    quick: Annotated[bool, _switch(
        "--quick", "One round, no 4k context or batch 32, a shorter quality check.", _BENCH_PANEL)] = False,
    threads: Annotated[int | None, _measure(
        "INT", "Threads per engine. Default: lmcli's choice for this machine (see 'lmcli info').", min=1,
        max=1024)] = None,
    background_load: Annotated[int | None, _measure(
        "N", "Also measure prefill and decode while N busy loops keep cores taken (a shared machine), beside "
             "the quiet figures; the loops are stopped at the end.", min=0, max=256)] = None,
    sections: Annotated[str | None, _measure(
        "LIST", "Parts of the bench to run, comma-separated: engines (the engine comparison) or "
                f"{', '.join(n for n in _BENCH_SECTIONS if n != 'engines') or 'none other yet'}. "
                f"Default: {_listed(_BENCH.sections)}.")] = None,
    as_json: Annotated[bool, _switch("--json", "Print the results as JSON instead of tables.")] = False,
    as_markdown: Annotated[bool, _switch(
        "--markdown", "Print the engine comparison as a Markdown table, with the CPU and the command.")] = False,
) -> None:
    """Benchmark lmcli (each weight format), transformers and llama.cpp on the same weights (see lmcli/bench/main.py)."""
    from lmcli.bench import main as bench_module

    options: dict[str, Any] = dict(
        checkpoint=str(checkpoint) if checkpoint is not None else None,
        model=model, device=device.value, dtype=dtype.value, engines=engines, formats=formats,
        max_new_tokens=max_new_tokens, batch_size=batch_size, prompt_tokens=prompt_tokens,
        prefill_tokens=prefill_tokens, repeats=repeats, contexts=contexts, scaling_batches=scaling_batches,
        skip_quality=skip_quality, quick=quick, threads=threads, background_load=background_load, sections=sections,
        as_json=as_json, as_markdown=as_markdown,
    )
    # Unset options are left out so bench/main.py's own defaults apply (and are validated there).
    bench_module.main(**{k: v for k, v in options.items() if v is not None and v is not False})


def main() -> None:
    """The console-script entry point."""
    defer_collection(sys.argv)  # until the model is loaded (_load)
    app()
