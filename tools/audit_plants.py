"""The planted bugs of the audit (docs/testing.md), one realistic single-line bug each, run by
tools/audit_plant.py: the file, the exact text it replaces and what a user would see."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Plant:
    id: str
    area: str
    file: str
    old: str  # occurs exactly once in the file
    new: str
    effect: str  # what a user would see
    tests: tuple[str, ...] = ()  # instead of the area's
    pytest_args: tuple[str, ...] = ()


# The tests relevant to each area's modules (a plant may name its own instead), and pytest arguments
# per area: the chat's two real-model REPL tests take minutes on a busy machine and test the same
# session code as the tiny-model ones.
AREA_ARGS = {"chat": ("-k", "not real_model")}
AREAS = {
    "openai": ("tests/test_openai_batch.py", "tests/test_openai_batch_fields.py"),
    "chat": ("tests/test_chat_sequences.py", "tests/test_chat.py"),
    "samplers": ("tests/test_sampling.py", "tests/test_samplers.py", "tests/test_sampler_edges.py",
                 "tests/test_cli_sampling.py"),
    "settings": ("tests/test_settings_defaults.py", "tests/test_settings_table.py", "tests/test_cli_flags.py",
                 "tests/test_cli_sampling.py"),
    "names": ("tests/test_model_names.py", "tests/test_resolve.py"),
    "kernels": ("tests/test_linear.py", "tests/test_fused.py", "tests/test_quant_gguf.py"),
    "parallel": ("tests/test_distributed.py",),
    "jobs": ("tests/test_jobs.py", "tests/test_job_durability.py", "tests/test_kill_resume.py"),
    "structured": ("tests/test_structured.py", "tests/test_structured_cli.py"),
    "speculative": ("tests/test_speculative.py",),
    "encdec": ("tests/test_encdec.py", "tests/test_encdec_cli.py"),
    "threads": ("tests/test_threads.py",),
}

OB, CS, CH, SA, DC, MD, ST = ("lmcli/jobs/openai_batch.py", "lmcli/chat/session.py", "lmcli/chat/repl.py",
                              "lmcli/generation/sampling.py", "lmcli/settings/table.py", "lmcli/settings/model_defaults.py",
                              "lmcli/settings/generation_settings.py")
MN, FP, MR = "lmcli/resolve/model_names.py", "lmcli/io/fingerprint.py", "lmcli/resolve/model_ref.py"
KE, LI, KP, QS = "lmcli/kernels/matmul.py", "lmcli/kernels/linear.py", "lmcli/kernels/plan.py", "lmcli/io/group_quantized.py"
DI, DJ, JO, JI, RO = "lmcli/distributed.py", "lmcli/jobs/distributed.py", "lmcli/jobs/runner.py", "lmcli/jobs/input.py", "lmcli/generation/rows.py"
CO, SP, TH = "lmcli/generation/constraints.py", "lmcli/generation/speculative.py", "lmcli/threads.py"
CN = "lmcli/settings/constraint.py"  # the constraint as a setting (its masks are CO's)
ED, EDR, EDC = "lmcli/models/encoder_decoder.py", "lmcli/models/encoder_decoder_run.py", "lmcli/models/encoder_decoder_config.py"
T5, BA = "lmcli/models/t5.py", "lmcli/models/bart.py"
OPENAI_AND_STRUCTURED = (*AREAS["openai"], "tests/test_structured_cli.py::test_openai_batch_response_format")
# The fingerprint and resume-by-model tests live with the OpenAI batch tests.
FINGERPRINTS = (*AREAS["names"], "tests/test_openai_batch.py::test_fingerprint_follows_content_not_place",
                "tests/test_openai_batch.py::test_resume_refuses_another_model_and_accepts_a_copy")
SETTINGS_AND_JOBS = (*AREAS["settings"], *AREAS["jobs"], "tests/test_openai_batch.py")

PLANTS = [
    # --- OpenAI batch files
    Plant("O1", "openai", OB, '"n": (1,), "stream"', '"n": (1, 2), "stream"',
          'a body with "n": 2 is accepted and answered with one choice instead of refused'),
    Plant("O2", "openai", OB, '            if not body.get("logprobs"):\n', '            if body.get("logprobs") is None:\n',
          '"logprobs": false with "top_logprobs" is accepted and returns logprobs'),
    Plant("O3", "openai", OB, 'if body.get("logprobs") is not None else None', 'if body.get("logprobs") else None',
          'a completions body with "logprobs": 0 gets no logprobs (OpenAI gives the chosen tokens\')'),
    Plant("O4", "openai", OB, "if isinstance(value, list) and len(value) == 1:", "if isinstance(value, list):",
          'a completions "prompt" list of several prompts silently answers the first instead of refusing'),
    Plant("O5", "openai", OB, 'content = "".join(p["text"] for p in content)', 'content = " ".join(p["text"] for p in content)',
          "a chat message in text parts is joined with spaces: the model sees other text"),
    Plant("O6", "openai", OB, '"total_tokens": prompt_tokens + completion_tokens', '"total_tokens": completion_tokens',
          "usage.total_tokens leaves out the prompt"),
    Plant("O8", "openai", OB, "message = message.replace(f'\"{row_key}\"', f'body field \"{body_key}\"')",
          "message = message.replace(f'\"{row_key}\"', f'\"{row_key}\"')",
          'an error names lmcli\'s "max_new_tokens" instead of the body field "max_tokens" the user wrote'),
    Plant("O9", "openai", OB, '        return {"json": True}\n', "        return {}\n",
          'response_format json_object is accepted but not enforced: free text comes back',
          tests=OPENAI_AND_STRUCTURED),
    Plant("O10", "openai", OB, 'return {"json_schema": spec["schema"]}', 'return {"json_schema": spec}',
          "response_format json_schema enforces the wrapper object, not the schema", tests=OPENAI_AND_STRUCTURED),
    # --- chat
    Plant("C1", "chat", CS, "for index in range(len(self.messages) - 1, first - 1, -1):",
          "for index in range(len(self.messages) - 1, first, -1):", "/undo with one exchange says nothing to undo"),
    Plant("C2", "chat", CS, "self.hidden = min(self.hidden, len(self.messages) - first)",
          "self.hidden = min(self.hidden, len(self.messages))",
          "/undo back past dropped turns with a system message: the next message is hidden from the model"),
    Plant("C3", "chat", CS, "while first + hidden < len(messages) - 1 and len(ids) > room // 2:",
          "while first + hidden < len(messages) - 1 and len(ids) > room:",
          "an outgrown chat drops just enough, so it is recomputed again at every following turn"),
    Plant("C4", "chat", CS, "limit = min(len(self._cached_ids), len(ids) - 1)", "limit = min(len(self._cached_ids), len(ids))",
          "resending a conversation the cache already holds feeds the model no token (crash or wrong reply)"),
    Plant("C5", "chat", CS, "self._cached_ids = (ids + result.tokens)[:cached_after]", "self._cached_ids = ids[:cached_after]",
          "the reply's tokens are forgotten as cached: the next turn's cache holds tokens it does not account for"),
    Plant("C7", "chat", CS, "self.messages = self.messages[:1] if self.system is not None else []", "self.messages = []",
          "/clear forgets the system message it says it keeps"),
    Plant("C8", "chat", CS, 'if message["role"] == "system" and number != 1:', 'if message["role"] == "system" and number != 0:',
          "a transcript that starts with a system message is refused"),
    Plant("C9", "chat", CH, "            message = message[1:]\n", "            message = message[2:]\n",
          "//text sends 'text' instead of '/text'"),
    Plant("C10", "chat", CH, 'if context is None and saved is not None and isinstance(saved.get("context"), int):',
          'if saved is not None and isinstance(saved.get("context"), int):',
          "--resume with --context: the transcript's context wins over the flag"),
    Plant("C11", "chat", CH, "settings, set(options.explicit), options.resume)", "settings, set(), options.resume)",
          "--resume with a flag (--temperature): the transcript's setting wins over the flag"),
    Plant("C13", "chat", CS, '"0" if _parse_bool(value, name) else str(DEFAULT_TEMPERATURE)',
          'str(DEFAULT_TEMPERATURE) if _parse_bool(value, name) else "0"', "/set greedy on samples; off decodes greedily"),
    # --- samplers
    Plant("S1", "samplers", "lmcli/generation/nucleus.py", "drop_sorted = cumulative <= 1 - self.top_p", "drop_sorted = cumulative < 1 - self.top_p",
          "top-p keeps a token whose exclusion leaves exactly p (transformers drops it)"),
    Plant("S2", "samplers", SA, "return logits.masked_fill(probs < floor, float(\"-inf\"))",
          "return logits.masked_fill(probs <= floor, float(\"-inf\"))", "min-p drops tokens exactly at the floor"),
    Plant("S4", "samplers", SA, "generated = input_ids[:, prompt_length:]", "generated = input_ids[:, prompt_length - 1:]",
          "presence/frequency penalties count the prompt's last token as generated"),
    Plant("S5", "samplers", SA, "ends_like_text &= starts[None, :] >= self.pad_counts", "ends_like_text &= starts[None, :] > self.pad_counts",
          "in a padded batch n-gram blocking misses the n-gram at the start of a row's prompt"),
    Plant("S7", "samplers", SA, "steps = _PROCESSORS if self.greedy else (*_PROCESSORS, *_WARPERS)",
          "steps = _PROCESSORS if self.greedy else (*_WARPERS, *_PROCESSORS)",
          "penalties act after temperature and truncation: other samples than transformers'"),
    Plant("S8", "samplers", SA, "chosen = torch.searchsorted(cdf, threshold, right=True)",
          "chosen = torch.searchsorted(cdf, threshold, right=False)",
          "a draw landing on a cdf step picks the token before it (possibly one of probability 0)"),
    Plant("S9", "samplers", SA, "seeds = [int(seed)] * batch_size", "seeds = [int(seed) + i for i in range(batch_size)]",
          "with one --seed a row's sample depends on its place in the batch"),
    Plant("S10", "samplers", SA, "seen = torch.where(seen < 0, seen * self.penalty, seen / self.penalty)",
          "seen = torch.where(seen > 0, seen * self.penalty, seen / self.penalty)",
          "repetition penalty encourages repeats of positive-logit tokens"),
    Plant("S11", "samplers", SA, 'getattr(p, "needs_history", True) for p in self.processors',
          'getattr(p, "needs_history", False) for p in self.processors',
          "a caller's plain processor is given no text (penalties of the API see nothing)"),
    Plant("S12", "samplers", SA, "        return counts\n", "        return counts > 0\n",
          "frequency penalty acts as a presence penalty (one subtraction whatever the count)"),
    # --- settings and model defaults
    Plant("D1", "settings", MD, 'if data.get("do_sample") is False:', 'if not data.get("do_sample"):',
          "a generation_config.json without do_sample makes the model greedy"),
    Plant("D2", "settings", MD, '"temperature": values.get("temperature") or 1.0', '"temperature": values.get("temperature", 1.0)',
          "a greedy model's config with a top_k fails to load"),
    Plant("D3", "settings", MD, "directory = path if path.is_dir() else path.parent", "directory = path.parent",
          "an HF directory's generation_config.json is ignored (its parent's read)"),
    Plant("D4", "settings", DC, "            return value <= self.off\n", "            return value < self.off\n",
          "a GGUF with general.sampling.top_k = 0 (llama.cpp's off) fails to load"),
    Plant("D5", "settings", DC, "DEFAULT_MAX_NEW_TOKENS = 128", "DEFAULT_MAX_NEW_TOKENS = 256",
          "without -n a completion is 256 tokens, not the documented 128"),
    Plant("D6", "settings", ST, "DEFAULT_TEMPERATURE = 0.8", "DEFAULT_TEMPERATURE = 1.0",
          "lmcli's default temperature is 1.0, not the documented 0.8"),
    Plant("D7", "settings", ST, "        if flagged & set(TRUNCATION):\n", "        if flagged >= set(TRUNCATION):\n",
          "--top-k with a row's top_p: both apply (the flag's truncation should stand whole)", tests=SETTINGS_AND_JOBS),
    Plant("D8", "settings", ST, 'if self.source("temperature") == FLAG and self.temperature == 0:',
          'if self.source("temperature") == FLAG:', "--temperature 0.7 drops every row's top_k/top_p",
          tests=SETTINGS_AND_JOBS),
    Plant("D9", "settings", ST, 'if name != "max_new_tokens")', 'if name not in ("max_new_tokens", "temperature"))',
          "rows with different temperatures share one batch: all but one get another row's temperature",
          tests=SETTINGS_AND_JOBS),
    Plant("D10", "settings", ST, "if f.compare and f.name not in SPECULATION}",
          'if f.compare and f.name not in (*SPECULATION, "stop")}',
          "--resume accepts an output made with other stop strings", tests=SETTINGS_AND_JOBS),
    Plant("D12", "settings", ST, "temperature = changes.get(\"temperature\", self.temperature)",
          "temperature = self.temperature", "a greedy model's top_k is kept: loading it fails"),
    # --- model names, fingerprints, the resolved model
    Plant("N1", "names", MN, "if main.is_file() and (snapshots / main.read_text().strip()).is_dir():", "if main.is_file():",
          "refs/main naming a snapshot that is gone: 'incomplete download' instead of the newest snapshot"),
    Plant("N2", "names", MN, "commit = ref.read_text().strip() if ref.is_file() else revision", "commit = revision",
          "ORG/NAME@v1.0 (a tag under refs/tags... or a branch) is not found"),
    Plant("N3", "names", MN, "if d.name.lower() == wanted.lower()", "if d.name == wanted",
          "-m org/name finds nothing when the cache spells it Org/Name"),
    Plant("N4", "names", MN, 'candidates += [repo, repo.replace("/", "--")]', "candidates += [repo]",
          "a models-directory entry ORG--NAME/ is not found by -m ORG/NAME"),
    Plant("N5", "names", MN, "return max(candidates, key=lambda d: d.stat().st_mtime, default=None)",
          "return min(candidates, key=lambda d: d.stat().st_mtime, default=None)",
          "without refs/main the oldest snapshot is used"),
    Plant("N7", "names", FP, " for i in range(1, SAMPLED_CHUNKS)] + [size - CHUNK_BYTES]:", " for i in range(1, SAMPLED_CHUNKS)]:",
          "a change in a large weights file's last MiB keeps the fingerprint: resume accepts another model",
          tests=FINGERPRINTS),
    Plant("N8", "names", FP, 'files = [tokenizer_path, tokenizer_path.parent / "tokenizer_config.json"]', "files = [tokenizer_path]",
          "a --tokenizer's chat template (tokenizer_config.json) is left out of the fingerprint",
          tests=FINGERPRINTS),
    Plant("N9", "names", FP, "        add(path.suffix, path)\n", "        add(path.name, path)\n",
          "a renamed copy of a .gguf has another fingerprint: resume refuses it",
          tests=FINGERPRINTS),
    Plant("N10", "names", MR, "return read_model_defaults(self.path)", "return read_model_defaults(self.checkpoint_dir)",
          "a GGUF's general.sampling defaults are ignored"),
    Plant("N11", "names", MR, "return checkpoint_fingerprint(self.path, self.tokenizer_path, self.preset)",
          "return checkpoint_fingerprint(self.path, None, self.preset)",
          "--tokenizer is left out of the fingerprint: resume accepts rows made with another tokenizer",
          tests=FINGERPRINTS),
    # --- quantized kernels and the kernel plan
    Plant("K1", "kernels", KE, "slab = max(1, (1 << 20) // self.columns // self.layout.block) * self.layout.block",
          "slab = max(1, (1 << 20) // self.columns // self.layout.block)",
          "packing a large weight in slabs that are not whole blocks: the default model fails to load or is wrong"),
    Plant("K2", "kernels", KE, "return (picked >> ((pos % 2) * 4)[:, None]) & 15", "return (picked >> ((pos % 2) * 2)[:, None]) & 15",
          "embedding rows of int4-packed matrices read the wrong nibble"),
    Plant("K3", "kernels", LI, "if kernel_group % 32 and kernel_name not in (\"dequantise\", \"native\"):",
          "if kernel_group % 64 and kernel_name not in (\"dequantise\", \"native\"):",
          "Q4 weights (groups of 32) silently fall back to dequantise + F.linear: several times slower"),
    Plant("K4", "kernels", LI, "seen.add(id(module.kernel))", "seen.add(id(module))",
          "lmcli info counts a tied quantized head's weights twice"),
    Plant("K5", "kernels", LI, "torch.zeros(p.out_features, dtype=present.dtype", "torch.zeros(p.in_features, dtype=present.dtype",
          "fusing a biased part with an unbiased one of another width fails or shifts the biases"),
    Plant("K6", "kernels", KP, "if device.type == \"cuda\" or not fast_kernels():\n        return torch.bfloat16",
          "if device.type == \"cuda\" or not fast_kernels():\n        return torch.float32",
          "quantized models run with float32 activations by default: slower, other text than documented"),
    Plant("K7", "kernels", KP, "torch.bfloat16: 2e-2, torch.float16", "torch.bfloat16: 2e-3, torch.float16",
          "the int4 kernel fails its probe: dequantise + F.linear chosen silently (much slower)"),
    Plant("K9", "kernels", QS, "step = ((high - low) / 15).clamp(min=1e-12)", "step = ((high - low) / 16).clamp(min=1e-12)",
          "--quantize int4 rounds to 16 steps of a 15-step range: larger error than round-to-nearest"),
    Plant("K10", "kernels", KE, "values = 16 * nibbles[..., 0] + nibbles[..., 1]", "values = nibbles[..., 0] + 16 * nibbles[..., 1]",
          "int8 (Q8_0/Q6_K) embedding rows come out wrong"),
    # --- tensor and data parallel
    Plant("T1", "parallel", DI, "self.vocab_rows = -(-config.vocab_size // size)", "self.vocab_rows = config.vocab_size // size",
          "a vocabulary that does not divide loses its last tokens under --tp"),
    Plant("T2", "parallel", DI, "return torch.cat(parts, dim=-1)[..., : self.config.vocab_size]", "return torch.cat(parts, dim=-1)",
          "--tp logits include padding columns"),
    Plant("T3", "parallel", DJ, "    if order is not None:\n        lines.sort(", "    if order is None:\n        lines.sort(",
          "a data-parallel job's output is not in input order"),
    Plant("T5", "parallel", DI, "return lazy.read() if self.rank == 0 else torch.zeros(shape)", "return lazy.read()",
          "a row-parallel bias is added once per rank"),
    # --- jobs
    Plant("J1", "jobs", JO, "            dropped.append(number)  # failed rows are retried\n",
          "            pass  # failed rows are retried\n",
          "--resume keeps failed rows in the file beside their retried rows (an id twice)"),
    Plant("J2", "jobs", JO, "        if key in finished:\n", "        if key in kept:\n",
          "an output with one id on two complete lines is resumed instead of refused"),
    Plant("J3", "jobs", JO, 'm.get("fingerprint") != model_record["fingerprint"]', 'm.get("name") != model_record["name"]',
          "--resume with another model under the same name is accepted",
          tests=(*AREAS["jobs"], FINGERPRINTS[-1])),
    Plant("J4", "jobs", JO, 'open(self._write_to, "a" if self.resume else "w"', 'open(self._write_to, "w"',
          "--resume truncates the rows already finished"),
    Plant("J5", "jobs", JO, "        if id_key(row.id) not in finished_ids:\n", "        if row.id not in finished_ids:\n",
          "after a batch fails, its finished rows are generated and written again"),
    Plant("J6", "jobs", JO, 'self.failed += row.get("error") is not None', 'self.failed += "error" in row',
          "an OpenAI batch job whose rows all succeed exits 1 ('error': null counted as failed)",
          tests=(*AREAS["jobs"], *AREAS["openai"])),
    Plant("J8", "jobs", JI, 'row_id = obj.get("id", number)', 'row_id = obj.get("id", number - 1)',
          "a row without id gets a 0-based id (the docs say its 1-based line number)"),
    Plant("J9", "jobs", JI, 'yield number, raw.removeprefix(b"\\xef\\xbb\\xbf") if number == 1 else raw', "yield number, raw",
          "an input with a byte order mark: the first row is invalid JSON / prompt starts with U+FEFF"),
    Plant("J10", "jobs", RO, "return ids[-keep:], len(ids) - keep", "return ids[:keep], len(ids) - keep",
          "a prompt longer than the context keeps its start, not its end"),
    Plant("J11", "jobs", RO, "max_new_tokens=max(r.settings.max_new_tokens for r in rows),",
          "max_new_tokens=rows[0].settings.max_new_tokens,",
          "rows batched with a shorter row stop at its max_new_tokens ('length' early)"),
    # --- structured output
    Plant("X1", "structured", CN, '_JSON_OPTIONS = {"whitespace_flexible": False,', '_JSON_OPTIONS = {"whitespace_flexible": True,',
          "--json lets the model pad an object with whitespace until the token limit"),
    Plant("X2", "structured", CN, "if values.get(kind) not in (None, False)]", "if values.get(kind) is not None]",
          'a job row with "json": false is refused ("--json must be true")',
          tests=(*AREAS["structured"], "tests/test_jobs.py")),
    Plant("X3", "structured", CN, "CONSTRAINED_MAX_NEW_TOKENS = 512", "CONSTRAINED_MAX_NEW_TOKENS = 128",
          "a constrained row without -n stops at 128 tokens: objects cut off"),
    Plant("X4", "structured", CO, "restart = ahead is not None or (self._seen != -1 and length != self._seen + 1)",
          "restart = ahead is not None",
          "a mask reused for a second generate() continues the first's grammar state"),
    Plant("X6", "structured", CO, 'pieces.append(bytes([int(match.group(1), 16)]) if match else piece.replace("\\u2581", " ").encode())',
          "pieces.append(bytes([int(match.group(1), 16)]) if match else piece.encode())",
          "SentencePiece vocabularies (Gemma) are constrained with '▁' for spaces: wrong or no output"),
    Plant("X7", "structured", CN, "elif key in _SCHEMA_MAPS and isinstance(value, dict):", "elif key in _SCHEMA_LISTS and isinstance(value, dict):",
          "a typo such as 'requird' inside properties is silently ignored"),
    # --- speculation (prompt lookup)
    Plant("P1", "speculative", SP, "if kept and not stop:", "if kept:",
          "prompt lookup goes on after EOS when the guess continues past it"),
    Plant("P2", "speculative", SP, "want = min(self.k, room - 1)",
          "want = min(self.k, room)",
          "prompt lookup can emit one token more than max_new_tokens"),
    Plant("P3", "speculative", SP, "first = int(ids[int((~mask).sum())])", "first = int(ids[0])",
          "in a padded batch processors see pads as the pad token: repetition penalty text differs from plain"),
    Plant("P4", "speculative", SP, "del row.new_tokens[step + 1:]", "del row.new_tokens[step:]",
          "a batched row stopped by a stop string loses its last token from the returned ids"),
    # --- encoder-decoders
    Plant("E1", "encdec", EDR, "            return self.limit - 1\n", "            return self.limit\n",
          "BART/Marian with -n past the decoder's positions: index error instead of a warning and a shorter text"),
    Plant("E3", "encdec", T5, 'num_hidden_layers=int(hf.get("num_decoder_layers") or layers),', "num_hidden_layers=layers,",
          "a T5 with fewer decoder than encoder layers fails to load"),
    Plant("E4", "encdec", T5, 'activation = "gelu_new" if projection == "gated-gelu" else parts[-1]', "activation = parts[-1]",
          "Flan-T5 (gated-gelu) runs exact gelu, not gelu_new: logits off from transformers"),
    Plant("E5", "encdec", RO, "prompt_length=1 if encoder_decoder else width,", "prompt_length=width,",
          "an encoder-decoder with min_new_tokens / penalties counts the decoder's tokens from the encoder input's width",
          tests=(*AREAS["encdec"],)),
    Plant("E6", "encdec", RO, "RowText(tokenizer, row.settings.stop, () if encoder_decoder else row.prompt_ids)",
          "RowText(tokenizer, row.settings.stop, row.prompt_ids)",
          "an encoder-decoder's text is decoded after the encoder input's tokens (wrong first characters)"),
    Plant("E7", "encdec", BA, 'embed_scale=d_model**0.5 if hf.get("scale_embedding") else 1.0,', "embed_scale=d_model**0.5,",
          "BART without scale_embedding scales its embeddings: wrong text"),
    # --- threads
    Plant("H1", "threads", TH, "min(self.load, max(self.runnable - 1, 0))", "min(self.load, max(self.runnable, 0))",
          "lmcli counts itself as busy: one thread too few on a quiet machine"),
    Plant("H2", "threads", TH, "threads = max(machine.cpus - busy, 1)", "threads = machine.cpus - busy",
          "on a fully busy machine OMP_NUM_THREADS=0"),
    Plant("H3", "threads", TH, "elif not follows_load and (busy or machine.local_ranks > 1):", "elif not follows_load and busy:",
          "torchrun ranks sharing a quiet machine spin against each other"),
]

# --- start-up: the packed-weights cache (io/packed_cache.py, kernels/packed_model.py), io/atomic.py, the
# packed entry's place in loading.py
AREAS["startup"] = ("tests/test_startup_packed.py", "tests/test_atomic.py")
PC, PM, AT, LO = "lmcli/io/packed_cache.py", "lmcli/kernels/packed_model.py", "lmcli/io/atomic.py", "lmcli/loading.py"
STARTUP_AND_JOBS = (*AREAS["startup"], "tests/test_job_durability.py")
PLANTS += [
    Plant("U1", "startup", PC, '"dtype": "auto" if dtype is None or str(dtype) == "auto" else str(dtype),',
          '"dtype": "auto",', "--dtype float32 after a start without it maps the bfloat16 entry: other logits"),
    Plant("U2", "startup", PC, 'for name in ("LMCLI_KERNEL", "LMCLI_FAST_KERNELS", "LMCLI_NATIVE")}',
          'for name in ("LMCLI_KERNEL", "LMCLI_NATIVE")}',
          "--fast-kernels after a start without it keeps the batch-invariant plan of the entry"),
    Plant("U3", "startup", PC, "for offset in range(0, total, PIECE_BYTES)]", "for offset in range(0, total - PIECE_BYTES, PIECE_BYTES)]",
          "damage in an entry's last 4 MiB goes unchecked: wrong logits from a damaged cache"),
    Plant("U4", "startup", AT, "            file.flush()\n            os.fsync(file.fileno())\n", "            file.flush()\n",
          "a durable write (a resumed job's rewritten output) is renamed into place before it is on disk",
          tests=STARTUP_AND_JOBS),
    Plant("U5", "startup", PC, 'body["key"].get("source") == key["source"]:', 'body["key"].get("source") != key["source"]:',
          "a changed GGUF's old entries stay in the cache (and another file's of the same stem go)"),
    Plant("U6", "startup", AT, "if pid.isdigit() and not _pid_alive(int(pid)):", "if pid.isdigit() and _pid_alive(int(pid)):",
          "a live writer's temporary is removed under it (and a dead one's kept forever)", tests=STARTUP_AND_JOBS),
    Plant("U7", "startup", LO, 'if resolved.kind != "gguf" or quantize is not None or device.type != "cpu"',
          'if resolved.kind != "gguf" or device.type != "cpu"',
          "--quantize int8 on a GGUF maps the entry of a plain load: the file's own quantization, not int8"),
    Plant("U8", "startup", PM, "if (plan.kernel, plan.large_rows) != (choice.kernel, choice.large_rows):",
          "if plan.large_rows != choice.large_rows:",
          "an entry made under another kernel plan is used (the old kernel), not rebuilt"),
]

# --- continuous batching, the prefix cache and the streamed job input (issue 22's second audit)
CB, PX = "lmcli/generation/continuous.py", "lmcli/generation/prefix_cache.py"
AREAS["continuous"] = ("tests/test_continuous.py", "tests/test_continuous_input.py", "tests/test_continuous_jobs.py",
                       "tests/test_prefix_cache.py")
PLANTS += [
    Plant("Q1", "continuous", CB, "[[column - live.start if live is not None else 0]",
          "[[column - live.start + 1 if live is not None else 0]",
          "a row in a continuous batch decodes at positions one past its own: other text than its single run"),
    Plant("Q2", "continuous", CB, "batch.slot_is_token[place, start:batch.column] = True",
          "batch.slot_is_token[place, start + 1:batch.column] = True",
          "a row placed in the batch no longer attends to its prompt's first token: other text"),
    Plant("Q3", "continuous", PX, "limit = len(ids) - (0 if whole else 1)", "limit = len(ids)",
          "a prompt of whole blocks that begins a longer one seen before leaves nothing to compute (and has no "
          "kept logits): the job crashes"),
    Plant("Q4", "continuous", PX, "self._entries.popitem(last=False)", "self._entries.popitem(last=True)",
          "the prefix cache drops its most recently used block: the shared system prompt is recomputed"),
    Plant("Q5", "continuous", PX, "while self.bytes + entry.size > self.max_bytes:", "while self.bytes > self.max_bytes:",
          "the prefix cache grows one block past its memory bound"),
    Plant("Q6", "continuous", CB, "[row.seed] if policy.do_sample else None, 1, device)", "None, 1, device)",
          "a sampled row in a continuous job ignores its seed: other text than its single run, not reproducible"),
    Plant("Q7", "continuous", CB, "return  # finished at its first token", "pass  # finished at its first token",
          "a row done at its first token (-n 1, or EOS first) joins the batch anyway: written twice, or the job crashes"),
    Plant("Q8", "continuous", CB, "self.stats.busy += sum(busy)", "self.stats.busy += len(busy)",
          "--stats says the batch was 100% full whatever its occupancy"),
    Plant("Q9", "continuous", JI, "return JobRows(self.path, self.settings, self._keep, part)",
          "return JobRows(self.path, self.settings, None, part)",
          "a data-parallel rank's share of a resumed job forgets which rows are finished: they are written again"),
    Plant("Q10", "continuous", JI, "itertools.pairwise(ordered) if a == b)", "itertools.pairwise(bucket) if a == b)",
          "in a large input, two rows with one id far apart are accepted (two output rows with one id)"),
]
# Fresh plants in the samplers, settings and names modules (not tuned to the tests that exist).
PLANTS += [
    Plant("S13", "samplers", SA, "k = min(self.top_k, logits.shape[-1])", "k = self.top_k",
          "--top-k larger than the vocabulary crashes (topk past the last token) instead of keeping every token"),
    Plant("S14", "samplers", SA, "entropy = -(log_probs.exp() * log_probs).nansum(dim=-1, keepdim=True)",
          "entropy = -(log_probs.exp() * log_probs).sum(dim=-1, keepdim=True)",
          "typical-p after a processor that masks tokens (-inf) has a nan entropy: it keeps every token"),
    Plant("S15", "samplers", SA, "if input_ids.shape[1] - self.prompt_length >= self.min_new_tokens or",
          "if input_ids.shape[1] - self.prompt_length > self.min_new_tokens or",
          "--min-new-tokens N blocks EOS for N + 1 tokens"),
    Plant("D13", "settings", MD, "if value is not None and not (SETTINGS[name].off is not None and value == SETTINGS[name].off):",
          "if value is not None:", 'a generation_config.json with "top_k": 0 (transformers\' off) fails to load'),
    Plant("D14", "settings", MD, 'if SETTINGS[name].kind == "integer" and is_number(values[name])',
          'if SETTINGS[name].kind == "int" and is_number(values[name])',
          'a generation_config.json writing "top_k": 40.0 fails to load ("must be an integer")'),
    Plant("D15", "settings", DC, "(vocab_size is not None and token >= vocab_size)", "(vocab_size is not None and token > vocab_size)",
          "--logit-bias on the token id equal to the vocabulary size is accepted: an index error mid-run",
          tests=(*AREAS["settings"], "tests/test_samplers.py")),  # the bias's range is a sampler's rule too
    Plant("N12", "names", MN, "    if len(ggufs) > 1:\n", "    if len(ggufs) > 2:\n",
          "a models-directory entry with two .gguf files silently takes the first instead of asking which"),
    Plant("N13", "names", FP, 'DECIDING_FILES = ("config.json", "generation_config.json", "tokenizer.json",',
          'DECIDING_FILES = ("config.json", "tokenizer.json",',
          "a changed generation_config.json keeps the fingerprint: --resume accepts rows made with other defaults",
          tests=FINGERPRINTS),
    Plant("N14", "names", MN, 'return Path(os.environ["HF_HOME"]).expanduser() / "hub"',
          'return Path(os.environ["HF_HOME"]).expanduser()', "with HF_HOME set, -m ORG/NAME finds no model in the hub cache"),
]
# Two more in continuous batching: what happens to the rows of a batch when a row or a step fails.
PLANTS += [
    Plant("Q11", "continuous", CB, "                    self.batch = None\n", "                    pass\n",
          "after a batched step fails, its rows are run alone and then go on in the old batch too: written twice"),
    Plant("Q12", "continuous", CB, "                        isolate([row])\n", "                        self.alone(row)\n",
          "a row that fails to start goes to alone, not isolate (none: jobs/runner.py, the one caller, makes alone isolate)"),
]
# The prompt cache, LoRA adapters, beams and the server (their four survivors got tests: the ids, trim,
# adapter-digest and streamed-finish cases below).
PB, PX, LF, LK = "lmcli/io/prompt_blocks.py", "lmcli/generation/prefix_cache.py", "lmcli/io/lora_files.py", "lmcli/kernels/lora.py"
SV, SS, BM = "lmcli/serve/app.py", "lmcli/serve/scheduler.py", "lmcli/generation/beams.py"
AREAS["cache"] = ("tests/test_prompt_cache.py",)
AREAS["lora"] = ("tests/test_lora.py",)
AREAS["serve"] = ("tests/test_serve.py", "tests/test_serve_faults.py")
AREAS["beams"] = ("tests/test_beams.py", "tests/test_generation_rules.py", "tests/test_beams_cli.py")
PLANTS += [
    Plant("PC1", "cache", PB, "if stored.tolist() != list(ids):", "if False:",
          "a well-formed block of another prompt under this name (a collision, a copy) is restored: wrong text"),
    Plant("PC2", "cache", PB, "else (0, 0, e[0]))", "else (0, 0, -e[0]))",
          "a new process over the size bound deletes the most recently used blocks first"),
    Plant("PC3", "cache", PX, "                digest.update(tensor.detach().contiguous().float().numpy().tobytes())",
          "                pass", "an adapter trained again in place reads the blocks of its old weights",
          tests=("tests/test_lora.py::test_the_prompt_cache_never_gives_one_adapters_keys_to_another",)),
    Plant("PC4", "cache", PX, 'link = self.disk.key_digest.encode() if self.disk is not None else b""', 'link = b""',
          "two models' blocks share file names: each run deletes the other's as foreign"),
    Plant("L1", "lora", LF, "module_alpha / (math.sqrt(r) if rslora else r)", "module_alpha / (r if rslora else r)",
          "rsLoRA adapters scaled as plain LoRA"),
    Plant("L2", "lora", LF, "float(alpha) / a.shape[0] * user_scale", "float(alpha) / a.shape[1] * user_scale",
          "a GGUF LoRA's scale divided by the input width, not the rank"),
    Plant("L3", "lora", LK, "[] if c == NONE else", "list(range(count)) if c == NONE else",
          'a row asking "lora": "none" gets every adapter'),
    Plant("L4", "lora", LK, "for adapter in self.default[1:]:", "for adapter in self.default[1:2]:",
          "a stack of three adapters drops the third on a row alone"),
    Plant("L5", "lora", LF, "        return path, value\n    return spec, 1.0", "        return path, 1.0\n    return spec, 1.0",
          "--lora PATH:0.5 runs at scale 1"),
    Plant("L6", "lora", LK, "if any(wanted and wanted in name.lower() for name in model_names if name):", "if True:",
          "an adapter trained on another base model loads without a word"),
    Plant("B1", "beams", BM, "penalised = top_scores / float(cur_len + 1 - prompt_len) ** length_penalty",
          "penalised = top_scores / float(cur_len - prompt_len) ** length_penalty",
          "finished beams' length penalty one token short: other translations than transformers'"),
    Plant("B2", "beams", BM, "            log_probs = torch.log_softmax(log_probs, dim=-1)  # (B*K, V)\n", "            pass\n",
          "renormalize_logits (opus-mt's generation config) ignored"),
    Plant("V1", "serve", SV, "prompt_tokens = len(self.parsed.rows[0].prompt_ids)\n                        yield",
          "prompt_tokens = len(self.parsed.rows[0].prompt_ids) - 1\n                        yield",
          "a stream's usage chunk counts one prompt token short"),
    Plant("V2", "serve", SV, "finish = openai_batch.FINISH_REASONS.get(reason, reason)", "finish = reason",
          'a streamed reply ending at the end of turn says finish_reason "eos", not OpenAI\'s "stop"'),
    Plant("V3", "serve", SS, "if self._queued(len(rows)) > self.max_queue:", "if self._queued(len(rows)) > self.max_queue + 1:",
          "--max-queue N admits N + 1 waiting rows"),
]
# Reliability round three's fixes: exit 3, the limit named, the lock file, the thread note, the bounds.
BD = "lmcli/io/bounded.py"
AREAS["reliability"] = ("tests/test_structured_limits.py", "tests/test_hostile.py", "tests/test_small_fixes.py")
PLANTS += [
    Plant("R1", "reliability", CN, "    exit_code = 3\n", "    exit_code = 1\n",
          "a structured output cut by a limit exits 1, like a failed run: a script cannot tell it to retry with -n"),
    Plant("R2", "reliability", "lmcli/jobs/runs.py", "if len(result.tokens) < settings.max_new_tokens:  # generate() stopped first",
          "if len(result.tokens) <= settings.max_new_tokens:  # generate() stopped first",
          "a schema cut by -n is reported as cut by the context (advice: shorten the prompt)"),
    Plant("R3", "reliability", "lmcli/io/output_lock.py", "            os.unlink(path)  # while still holding it",
          "            pass  # while still holding it", "a job that ends cleanly leaves its .lock file",
          tests=("tests/test_kill_resume.py",)),
    Plant("R4", "reliability", TH, "elif count > machine.host_cpus:", "elif count > machine.host_cpus + 1:",
          "OMP_NUM_THREADS one past the CPUs is reported as taken (torch caps it silently)",
          tests=("tests/test_small_fixes.py", "tests/test_threads.py")),
    Plant("R5", "reliability", BD, "    if len(data) > limit:\n", "    if len(data) > limit + 1:\n",
          "a schema from a FIFO or device past the bound is cut at the bound plus one byte, not refused"),
    Plant("R6", "reliability", BD, "if int(levels.max()) > limit:", "if int(levels.max()) > limit + 1:",
          "a schema nested one level past the limit goes on to the recursive walks"),
    Plant("R7", "reliability", BD, "            if depth > limit:", "            if depth > limit + 1:",
          "a parsed value nested one level past the limit goes on to the recursive walks"),
]
