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
    from lmcli.resolve import default_model

    assert default_model.cache_dir() == cache


def test_the_package_has_no_import_circle_at_module_level():
    """Modules import each other at load time without a circle (issue 8). Imports inside functions are
    left out: they are deliberate, lazy, and run only once their module is complete."""
    import ast

    root = Path(__file__).resolve().parents[1] / "lmcli"
    modules = {}
    for path in root.rglob("*.py"):
        name = ".".join(path.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__")
        modules[name] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        imported = set()
        for node in ast.parse(path.read_text()).body:  # module level only; `if TYPE_CHECKING:` is not a statement of this list
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
            elif isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names}
        graph[name] = {m for m in imported if m in modules and m != name}

    state: dict[str, str] = {}

    def visit(name: str, path: list[str]) -> None:
        state[name] = "open"
        for imported in sorted(graph[name]):
            assert state.get(imported) != "open", "import circle: " + " -> ".join([*path, name, imported])
            if imported not in state:
                visit(imported, [*path, name])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [])
    assert "lmcli.models.base" in graph and "lmcli.generation.loop" in graph  # the walk saw the package
