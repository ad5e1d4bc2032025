"""Imports point down: the package's layers, each importing only itself and the layers below it.

    errors, autograd_state, usage  <  engine  <  optim  <  checkpoint  <  quant  <  hf  <  planner  <  trainer  <  integrations  <  cli

Every import counts, those inside functions too (a lazy import is still a dependency). ``models/`` (a
plain model with no parallelism in it) and ``quant/`` (the 4-bit format, tensors only) are leaves any layer
above the engine may use; ``autograd_state`` (one private torch probe) is a leaf the engine and ``quant/``
share. Two rules are spelled out because they are the ones that were broken: the engine imports nothing of
shardwise but itself, ``errors`` and ``autograd_state``; ``checkpoint/`` imports neither ``hf/``
(transformers, peft) nor the planner, ``integrations/`` or the trainer.

Inside the engine the same rule holds between its folders (``ENGINE_LAYERS``)::

    engine.base  <  engine.checks  <  engine.core  <  engine.surface, and the engine's loose modules (api, ...)

so the step (``core``) can be read and changed without the torch-API surface: it takes its parameters from
a factory and hands gradients to a sink that ``shard()`` supplies from above.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "shardwise"
LAYERS = ["errors", "autograd_state", "version", "usage", "engine", "models", "optim", "checkpoint", "quant", "hf", "planner", "trainer",
          "integrations", "cli"]
# What each layer may import beyond itself: the layers below it, with the engine's rule stricter.
ALLOWED = {layer: set(LAYERS[:i]) for i, layer in enumerate(LAYERS)}
ALLOWED["engine"] = {"errors", "autograd_state"}
ALLOWED["models"] = set()
ALLOWED["quant"] = {"errors", "autograd_state"}
ALLOWED["__init__"] = set(LAYERS)  # the public re-exports
ALLOWED["__main__"] = {"cli"}
# The trainer, the framework integrations and the CLI use the library as a user does, through the package root.
ROOT_IMPORTERS = {"__init__", "trainer", "integrations", "cli"}
THIRD_PARTY_FORBIDDEN = {"checkpoint": {"transformers", "peft"}, "engine": {"transformers", "peft"},
                         "optim": {"transformers", "peft"}}


# The engine's folders, bottom up; each imports only itself and the folders before it (the loose modules of
# engine/ and engine.surface sit above all of them and may import any).
ENGINE_LAYERS = ["base", "checks", "core"]


def _layer(module: str) -> str:
    """shardwise.engine.api -> 'engine'; shardwise.cli -> 'cli'; shardwise -> '__init__'."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1] if len(parts) > 1 else parts[:-1] + ["__init__"]
    return ".".join(parts) if parts[-1] != "__init__" else "shardwise"


def _imports(path: Path, module: str) -> list[tuple[int, str]]:
    """(line, imported module) for every import in the file, relative imports resolved."""
    out = []
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from shardwise import engine` imports the submodule shardwise.engine
            out += [(node.lineno, f"{base}.{a.name}" if base == "shardwise" else base) for a in node.names]
    return out


def _violations() -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        layer = _layer(module) if module != "shardwise" else "__init__"
        allowed = ALLOWED[layer] | {layer}
        for line, imported in _imports(path, module):
            top = imported.split(".")[0]
            if top == "shardwise":
                if imported == "shardwise" and layer not in ROOT_IMPORTERS:
                    found.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports the package root")
                elif imported != "shardwise" and _layer(imported) not in allowed:
                    found.append(f"{path.relative_to(PACKAGE.parent)}:{line} ({layer}) imports {imported}")
            elif top in THIRD_PARTY_FORBIDDEN.get(layer, ()):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{line} ({layer}) imports {top}")
    return found


def _engine_layer(module: str):
    """shardwise.engine.core.unit -> 'core'; None for a module outside the engine's layered folders."""
    parts = module.split(".")
    if len(parts) > 2 and parts[:2] == ["shardwise", "engine"] and parts[2] in ENGINE_LAYERS:
        return parts[2]
    return None


def _engine_violations() -> list[str]:
    found = []
    for path in sorted((PACKAGE / "engine").rglob("*.py")):
        module = _module_name(path)
        layer = _engine_layer(module)
        if layer is None:
            continue
        allowed = ENGINE_LAYERS[:ENGINE_LAYERS.index(layer) + 1]
        for line, imported in _imports(path, module):
            if imported.split(".")[:2] != ["shardwise", "engine"]:
                continue
            target = _engine_layer(imported) or ".".join(imported.split(".")[:3])
            if target not in allowed:
                found.append(f"{path.relative_to(PACKAGE.parent)}:{line} (engine.{layer}) imports {imported}")
    return list(dict.fromkeys(found))  # (one line per import statement)


def test_every_module_belongs_to_a_layer():
    strays = sorted({_layer(_module_name(p)) for p in PACKAGE.rglob("*.py")} - set(ALLOWED) - {"__init__"})
    assert not strays, f"modules outside the layer list {LAYERS}: {strays}"


def test_imports_point_down():
    violations = _violations()
    assert not violations, "imports that point up:\n" + "\n".join(violations)


def test_the_checker_sees_an_upward_import(tmp_path, monkeypatch):
    """The walk itself: an engine module importing the trainer is reported."""
    engine = tmp_path / "shardwise" / "engine"
    engine.mkdir(parents=True)
    (tmp_path / "shardwise" / "__init__.py").write_text("")
    (engine / "__init__.py").write_text("")
    (engine / "bad.py").write_text("def f():\n    from shardwise.trainer import loop\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", tmp_path / "shardwise")
    assert _violations() == ["shardwise/engine/bad.py:2 (engine) imports shardwise.trainer"]


def test_engine_folders_import_down():
    """engine.core imports nothing of engine.surface (nor of the loose modules above it); engine.checks
    nothing of engine.core or engine.surface; engine.base nothing of engine.checks, core or surface."""
    violations = _engine_violations()
    assert not violations, "engine imports that point up:\n" + "\n".join(violations)


@pytest.mark.parametrize("layer, imported", [("core", "shardwise.engine.surface.pieces"),
                                             ("base", "shardwise.engine.core.unit"),
                                             ("checks", "shardwise.engine.surface.pieces"),
                                             ("core", "shardwise.engine.api")])
def test_the_checker_sees_an_engine_folder_importing_up(tmp_path, monkeypatch, layer, imported):
    folder = tmp_path / "shardwise" / "engine" / layer
    folder.mkdir(parents=True)
    for init in (tmp_path / "shardwise", tmp_path / "shardwise" / "engine", folder):
        (init / "__init__.py").write_text("")
    (folder / "bad.py").write_text(f"def f():\n    import {imported}\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", tmp_path / "shardwise")
    assert _engine_violations() == [f"shardwise/engine/{layer}/bad.py:2 (engine.{layer}) imports {imported}"]


@pytest.mark.parametrize("pair", [("checkpoint/export.py", "hf/export_lora.py"), ("trainer/config.py", "trainer/hf_args.py")])
def test_former_cycles_stay_broken(pair):
    a, b = (PACKAGE / p for p in pair)
    ma, mb = _module_name(a), _module_name(b)
    a_imports_b = any(i == mb or i.startswith(mb + ".") for _, i in _imports(a, ma))
    b_imports_a = any(i == ma or i.startswith(ma + ".") for _, i in _imports(b, mb))
    assert not (a_imports_b and b_imports_a), f"{pair[0]} and {pair[1]} import each other"
