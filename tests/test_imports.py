"""The house's layers hold: the import-linter contracts in pyproject.toml, no import cycle
between project modules (imports inside functions count), and every module of the shared
core named in the core's contract so a new one cannot slip past it."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("specdec", "coordinator", "draft_worker", "target_worker")
# Rooms of specdec that are not the core; everything else directly under specdec/ is core.
ROOMS = {"specdec.runtime", "specdec.eagle", "specdec.train", "specdec.bench", "specdec.cli", "specdec.drafts"}
NOT_IMPORTED = {"specdec.__init__", "specdec.__main__"}


def contracts() -> list[dict]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


def test_import_contracts_are_kept():
    result = subprocess.run([sys.executable, "-c", "from importlinter.cli import lint_imports_command; "
                             "lint_imports_command()"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_no_import_cycles_between_project_modules():
    graph = grimp.build_graph(*PACKAGES)
    modules = sorted(graph.modules)
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[list[str]] = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for imported in sorted(graph.find_modules_directly_imported_by(module)):
            if state.get(imported) == 1:
                cycles.append(path[path.index(imported):] + [imported])
            elif imported not in state:
                visit(imported, path + [imported])
        state[module] = 2

    for module in modules:
        if module not in state:
            visit(module, [module])
    # A package importing its own submodule (an __init__ re-export) is not a cycle of ideas.
    real = [c for c in cycles if not all(m.startswith(c[0] + ".") or m == c[0] for m in c[1:-1])]
    assert not real, "import cycles: " + "; ".join(" -> ".join(c) for c in real)


def test_every_core_module_is_under_the_core_contract():
    core = next(c for c in contracts() if c["name"].startswith("The core"))
    named = set(core["source_modules"])
    on_disk = {f"specdec.{p.stem}" for p in (ROOT / "specdec").glob("*.py")} - NOT_IMPORTED
    on_disk |= {f"specdec.{p.name}" for p in (ROOT / "specdec").iterdir()
                if p.is_dir() and (p / "__init__.py").exists()}
    assert on_disk - ROOMS - named == set(), "core modules missing from the core contract"


def test_no_service_imports_another():
    rule = next(c for c in contracts() if c["type"] == "independence" and "coordinator" in c["modules"])
    assert set(rule["modules"]) == {"coordinator", "draft_worker", "target_worker"}
