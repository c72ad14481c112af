"""The packages form layers: no import cycle between them, none from a lower layer up; python_backend's wings (core:
the engine's process, triton: the Triton models, server: the `mol2 serve` process) import only downwards, and core
nothing of Triton; `mol2 --help` loads no torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Lowest first; a package may import only packages of a lower layer. From what the code needs: the engine; the
# demo's build (corpus readers, training) over it; the router (its data reuses the corpus readers); the server
# (it routes with the router); HeteroFold (its Triton models use the server's request helpers and launcher); the
# benchmarks, which measure all of them; the command line, which gathers every package's commands.
LAYERS = {"ced": 0, "engine_build": 1, "mol2_router": 2, "python_backend": 3, "heterofold": 4, "benchmarks": 5,
          "mol2_cli": 6}


def imported(path: Path, module: str) -> set[str]:
    """Every module `path` imports, at its top or inside a function, relative imports resolved."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            names.add(".".join(base + ([node.module] if node.module else [])))
    return names


def package_imports() -> dict[tuple[str, str], list[str]]:
    """(importer, imported) package pairs -> the modules where the import is written."""
    edges: dict[tuple[str, str], list[str]] = {}
    for package in LAYERS:
        for path in sorted((ROOT / package).rglob("*.py")):
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            for name in imported(path, module):
                target = name.split(".")[0]
                if target in LAYERS and target != package:
                    edges.setdefault((package, target), []).append(module)
    return edges


def test_every_first_party_package_has_a_layer():
    packages = {path.parent.name for path in ROOT.glob("*/__init__.py")}
    assert packages - {"tests"} == set(LAYERS)


def test_no_package_imports_one_above_it():
    upward = {f"{a} -> {b}": where for (a, b), where in package_imports().items() if LAYERS[b] >= LAYERS[a]}
    assert upward == {}


def test_no_import_cycle_between_packages():
    edges = package_imports()
    reach = {package: {b for (a, b) in edges if a == package} for package in LAYERS}
    for _ in LAYERS:  # transitive closure
        reach = {p: seen.union(*(reach[q] for q in seen)) for p, seen in reach.items()}
    assert [p for p, seen in reach.items() if p in seen] == []


# python_backend's wings, lowest first: which process a file runs in is the folder it sits in.
WINGS = {"core": 0, "triton": 1, "server": 2}
TRITON_ONLY = {"triton_python_backend_utils", "tritonclient", "python_backend.triton", "python_backend.server"}


def wing_imports() -> dict[str, set[str]]:
    """python_backend's modules (by wing-relative name) -> what each imports."""
    found = {}
    for path in sorted((ROOT / "python_backend").rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        found[module] = imported(path, module)
    return found


def test_every_backend_file_sits_in_a_wing():
    loose = [p.name for p in (ROOT / "python_backend").iterdir() if p.name not in ("__init__.py", "__pycache__")]
    assert sorted(loose) == sorted(WINGS)


def test_wings_import_only_downwards_and_core_nothing_of_triton():
    upward = []
    for module, names in wing_imports().items():
        wing = module.split(".")[1] if module.count(".") else None
        if wing not in WINGS:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "python_backend" and len(parts) > 1 and parts[1] in WINGS and WINGS[parts[1]] > WINGS[wing]:
                upward.append(f"{module} -> {name}")
            if wing == "core" and any(name == t or name.startswith(t + ".") for t in TRITON_ONLY):
                upward.append(f"{module} -> {name}")
    assert upward == []


def test_serve_options_name_every_engine_kind():
    from ced.engines import ENGINE_KINDS
    from python_backend.server import cli

    assert cli.ENGINE_KINDS == ENGINE_KINDS


def loaded_by(*argv: str) -> set[str]:
    """The modules a `mol2` command line imports, in a fresh interpreter."""
    code = ("import sys\nfrom mol2_cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            "print(' '.join(sys.modules), file=sys.stderr)")
    done = subprocess.run([sys.executable, "-c", code, *argv], cwd=ROOT, capture_output=True, text=True, check=True)
    assert "usage: mol2" in done.stdout
    return set(done.stderr.splitlines()[-1].split())


def test_help_imports_no_torch():
    for argv in (["--help"], ["serve", "--help"], ["router", "--help"], ["build", "--help"], ["chat", "--help"]):
        modules = loaded_by(*argv)
        assert "mol2_cli" in modules and not modules & {"torch", "transformers", "numpy", "aiohttp"}, argv
    assert "python_backend.server.cli" in loaded_by("serve", "--help")
    assert not {m for m in loaded_by("--help") if m.split(".")[0] in LAYERS} - {"mol2_cli"}
