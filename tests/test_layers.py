"""The layers: the core (edgetrain/) imports no role, the roles (coordinator/, edge_client/) never
reach the layer above them (the emulated fleet, experiments, the command line), and a board
installs without the gateway's extras.

Each check runs in a fresh interpreter, so an import made at import time anywhere (lazily, through
importlib) shows in its sys.modules; imports inside functions are caught by reading the sources.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROLES = ("coordinator", "edge_client")
ABOVE = r"edgetrain\.(emulator|experiment|commands|cli)(\.\w+)*"
"""Modules of the layer above the roles: the emulated fleet (with its light boards and job
simulator), experiments, and the `edgetrain` command."""
GATEWAY_ONLY = ("matplotlib", "tensorboard", "prometheus_client", "selenium", "torchvision")
"""What only the gateway's install (`edgetrain[gateway]`) and the tests bring: plots, dashboards,
a browser driver, dataset downloads."""


def _fresh(code: str, timeout_s: float = 300) -> subprocess.CompletedProcess:
    """Run `code` in a new interpreter from the repository root."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout_s)


def test_no_role_module_imports_the_layer_above() -> None:
    # Prepare: import every module of both roles, one at a time, noting what each brought in
    code = f"""
        import importlib, json, pkgutil, re, sys
        pulled = {{}}
        for package in {ROLES!r}:
            for info in pkgutil.walk_packages(importlib.import_module(package).__path__, package + "."):
                before = set(sys.modules)
                importlib.import_module(info.name)
                above = sorted(m for m in set(sys.modules) - before if re.fullmatch({ABOVE!r}, m))
                if above:
                    pulled[info.name] = above
        print(json.dumps(pulled))
    """

    # Execute
    result = _fresh(code)

    # Assert
    assert result.returncode == 0, result.stderr
    pulled = json.loads(result.stdout.splitlines()[-1])
    assert pulled == {}, f"role modules import the layer above them (module: what it brought in): {pulled}"


def _reaches_above(path: Path) -> list[str]:
    """Lines of `path` that import a module of the layer above, anywhere (also inside a function),
    or name one as a string (importlib, `python -m`)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = [node.value]
        else:
            continue
        if any(re.fullmatch(ABOVE, name) for name in names) or (
                isinstance(node, ast.ImportFrom) and node.module == "edgetrain"
                and {alias.name for alias in node.names} & {"emulator", "experiment", "commands", "cli"}):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_role_sources_name_no_module_of_the_layer_above() -> None:
    found = [line for role in ROLES for path in sorted((ROOT / role).rglob("*.py")) for line in _reaches_above(path)]
    assert found == [], f"role sources reach the layer above: {found}"


def _imports_a_role(path: Path) -> list[str]:
    """Lines of `path` that import coordinator or edge_client, anywhere in the file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = ([alias.name for alias in node.names] if isinstance(node, ast.Import) else
                 [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else [])
        if any(name.partition(".")[0] in ROLES for name in names):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_the_core_imports_neither_a_role_nor_the_layer_above() -> None:
    sources = [*(ROOT / "edgetrain").glob("*.py"), *(ROOT / "edgetrain" / "config").glob("*.py")]
    core = [path for path in sorted(sources) if path.name not in ("cli.py", "__main__.py")]
    found = [line for path in core for line in (*_reaches_above(path), *_imports_a_role(path))]
    assert found == [], f"core modules reach a role or the layer above: {found}"


def test_a_board_starts_without_the_gateway_extras() -> None:
    # Prepare: a board's install has none of the gateway-only packages
    code = f"""
        import importlib, importlib.abc, io, pkgutil, sys
        from contextlib import redirect_stdout

        class NotInstalled(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.partition(".")[0] in {GATEWAY_ONLY!r}:
                    raise ImportError(f"{{name}} is not installed on a board")
                return None

        sys.meta_path.insert(0, NotInstalled())
        import edge_client
        for info in pkgutil.walk_packages(edge_client.__path__, "edge_client."):
            importlib.import_module(info.name)
        from edgetrain.cli import main
        out = io.StringIO()
        with redirect_stdout(out):
            try:
                main(["client", "--help"])
            except SystemExit as e:
                assert e.code == 0, e.code
        assert "--coordinator" in out.getvalue(), out.getvalue()
        print("ok")
    """

    # Execute
    result = _fresh(code)

    # Assert
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr
