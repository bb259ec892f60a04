"""A config that claims far more weights than its files hold is refused before anything is built
(issue 31, defect 9: 65,536 layers built about 4 GB of modules, for minutes, before the refusal).

The bound lmcli checks (`loading.least_weights`) must never exceed a real model's count: checked against
transformers' own models of every preset config (built on the meta device: no memory)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap

import pytest
from cli_fixtures import REPO, subprocess_env, tiny_checkpoint  # noqa: F401 (fixture)

from lmcli import registry

transformers = pytest.importorskip("transformers")

_CHILD = textwrap.dedent("""
    import resource, sys, time
    import torch
    import lmcli
    from lmcli.errors import CheckpointError
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    try:
        lmcli.load(sys.argv[1])
    except CheckpointError as exc:
        print("refused:", exc)
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024  # kB on Linux
    print("grown:", grown)
""")


@pytest.mark.parametrize("field", ["num_hidden_layers", "hidden_size"])
def test_a_config_claiming_65536_layers_is_refused_before_anything_is_built(field, tiny_checkpoint, tmp_path):
    huge = tmp_path / "huge"
    shutil.copytree(tiny_checkpoint, huge)
    config = json.loads((huge / "config.json").read_text())
    config[field] = 65536
    if field == "hidden_size":
        config["head_dim"] = 16
    (huge / "config.json").write_text(json.dumps(config))
    child = subprocess.run([sys.executable, "-c", _CHILD, str(huge)], capture_output=True, text=True, timeout=60,
                           env=subprocess_env(), cwd=REPO)
    assert child.returncode == 0, child.stderr
    refused, grown = child.stdout.splitlines()
    assert refused.startswith(f"refused: {huge / 'model.safetensors'}: its config describes a model of at least ")
    assert "more than its files' " in refused
    # Peak memory past `import lmcli` (which imports torch): the config and the file's header, not the
    # 65,536 layers' modules. 64 MiB is a wide margin over what reading them takes.
    assert int(grown.removeprefix("grown: ")) < 64 << 20, grown


@pytest.mark.parametrize("preset", registry.list_presets())
def test_the_bound_never_exceeds_a_real_models_weights(preset):
    """transformers' model of each preset config, on the meta device: at least `least_weights` parameters."""
    import torch

    from lmcli.loading import least_weights

    hf = registry.preset_config(preset)
    assert hf is not None
    config = registry.config_from_hf(dict(hf))
    hf_config = transformers.AutoConfig.for_model(**hf)
    with torch.device("meta"):
        model = transformers.AutoModel.from_config(hf_config)
    count = sum(p.numel() for p in model.parameters())
    assert 0 < least_weights(config) <= count, (preset, least_weights(config), count)
