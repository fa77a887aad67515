"""Project-wide rules: the host-only engine never imports jax, imports between packages
go one way, and every package (the remapped kernels/ and server/ too) is installed."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENGINE = ROOT / "jvllm" / "engine"


def imported_modules(path: Path) -> list[str]:
    """Every module a source file imports, at the top or inside a function."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
    return names


def test_engine_sources_do_not_import_jax():
    offenders = [
        f"{path.name}: {n}"
        for path in sorted(ENGINE.glob("*.py"))
        for n in imported_modules(path)
        if n.split(".")[0] in ("jax", "flax")
    ]
    assert not offenders, f"jvllm/engine must stay host-only: {offenders}"


# (importer, what it must not import): each pair's dependency goes the other way only.
ONE_WAY = [
    ("jvllm/parallel", "jvllm.models"),
    ("jvllm/models/orbax_checkpoint.py", "jvllm.models.loader"),
    ("jvllm/models/spec.py", "jvllm."),
]


def test_imports_go_one_way():
    offenders = []
    for where, banned in ONE_WAY:
        target = ROOT / where
        for path in sorted(target.glob("*.py")) if target.is_dir() else [target]:
            bad = [n for n in imported_modules(path) if n.startswith(banned)]
            offenders += [f"{path.relative_to(ROOT)} imports {n}" for n in bad]
    assert not offenders, offenders


def test_importing_the_engine_loads_no_jax():
    modules = [f"jvllm.engine.{p.stem}" for p in ENGINE.glob("*.py") if p.stem != "__init__"]
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_package_is_installed():
    import tomllib

    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    # Package name -> its folder: jvllm/ as laid out, plus the package-dir remappings.
    roots = {"jvllm": ROOT / "jvllm"} | {
        name: ROOT / folder for name, folder in setuptools["package-dir"].items()
    }
    assert set(roots) - {"jvllm"} == {"jvllm.kernels", "jvllm.server"}
    found = set()
    for name, folder in roots.items():
        for init in folder.rglob("__init__.py"):
            found.add(".".join([name, *init.parent.relative_to(folder).parts]))
    assert {"jvllm.kernels", "jvllm.server", "jvllm.engine"} <= found
    assert found <= listed, f"add to [tool.setuptools] packages: {sorted(found - listed)}"
