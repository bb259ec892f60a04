"""The suite's own rules (conftest.py): under CI=true a skip fails; caches stay out of ~/.cache/lmcli."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from cli_fixtures import subprocess_env

SKIPPING_TESTS = {
    "test_skips.py": "import pytest\n\ndef test_needs_a_model():\n    pytest.skip('no model')\n",
    "test_missing_dependency.py": "import pytest\npytest.importorskip('no_such_module_here')\n\ndef test_x():\n    pass\n",
    "test_xfail.py": "import pytest\n\n@pytest.mark.xfail(strict=True)\ndef test_known_bug():\n    assert False\n",
}


def test_skips_fail_under_ci(tmp_path):
    shutil.copy(Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")
    for name, text in SKIPPING_TESTS.items():
        (tmp_path / name).write_text(text)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--continue-on-collection-errors",
         str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env=subprocess_env(CI="true"),
    )
    summary = result.stdout.strip().splitlines()[-1]
    assert result.returncode == 1, result.stdout
    assert "1 failed" in summary and "1 error" in summary and "skipped" not in summary, summary
    assert "1 xfailed" in summary  # an expected failure is not a skip
    assert "skipped under CI=true, which must not happen" in result.stdout and "no model" in result.stdout
    assert "no_such_module_here" in result.stdout


def test_the_suite_has_its_own_cache_dir():
    cache = Path(os.environ["LMCLI_CACHE_DIR"])
    assert cache.is_dir() and cache != Path.home() / ".cache" / "lmcli"
    from lmcli import default_model

    assert default_model.cache_dir() == cache
