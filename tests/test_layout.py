"""Project-wide rules: the host-only engine never imports jax, imports between packages
go one way, every package is installed, and no top-level folder hides an installed module."""

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
        for path in sorted(ENGINE.rglob("*.py"))
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


def test_the_runner_sees_the_engine_only_through_step_io():
    offenders = [
        f"{path.relative_to(ROOT)} imports {n}"
        for path in sorted((ROOT / "jvllm" / "runner").rglob("*.py"))
        for n in imported_modules(path)
        if n.startswith("jvllm.engine") and n != "jvllm.engine.step_io"
    ]
    assert not offenders, offenders


def test_no_module_is_over_450_lines():
    long = {
        str(path.relative_to(ROOT)): n
        for path in sorted((ROOT / "jvllm").rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > 450
    }
    assert not long, f"split these by responsibility: {long}"


def test_importing_the_engine_loads_no_jax():
    modules = [
        ".".join(p.relative_to(ROOT).with_suffix("").parts)
        for p in ENGINE.rglob("*.py")
        if p.stem != "__init__"
    ]
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_package_is_installed():
    import tomllib

    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    found = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for init in (ROOT / "jvllm").rglob("__init__.py")
    }
    assert {"jvllm.kernels", "jvllm.server", "jvllm.engine"} <= found
    assert found <= listed, f"add to [tool.setuptools] packages: {sorted(found - listed)}"


def test_top_level_folders_shadow_no_installed_module():
    """pytest (tests/ is a package) and the bench scripts put the checkout's root first on
    sys.path, so a top-level package there named like an installed module hides it: a
    top-level kernels/ once hid the `kernels` distribution that Transformers imports."""
    import importlib.metadata

    installed = importlib.metadata.packages_distributions()
    top = sorted(p.parent.name for p in ROOT.glob("*/__init__.py"))
    assert top == ["bench", "jvllm", "tests"]
    clashes = {name: installed[name] for name in top if name != "jvllm" and name in installed}
    assert not clashes, f"top-level packages named like installed modules: {clashes}"
