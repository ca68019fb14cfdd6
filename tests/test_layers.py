"""The layers of utils/ as docs/development.md draws them: each package imports only the packages below it, and no
module imports itself back through others. Read from the source (ast), so a function-level import counts as much as
one at the top of a file: an import put off to save start-up time is still an arrow."""

from __future__ import annotations

import ast
import sys
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Bottom to top; `run` is utils/run.py, the order of a run, which may use every layer but the sweeps. The sweeps sit
# beside it: they start runs as processes and read the run folder, never the training code.
LAYERS = ("common", "config", "run_folder", "cluster", "training", "publishing", "run", "sweeps")
CAN_IMPORT = {layer: set(LAYERS[: index + 1]) for index, layer in enumerate(LAYERS)}
CAN_IMPORT["sweeps"] -= {"cluster", "training", "publishing", "run"}


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(REPO).with_suffix("").parts)


def layer_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def imports(path: Path) -> set[str]:
    """The utils modules `path` imports, wherever in the file the import is."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("utils."):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("utils.")}
    return found


def import_graph() -> dict[str, set[str]]:
    modules = [path for path in sorted((REPO / "utils").rglob("*.py")) if path.stem != "__init__"]
    return {module_name(path): imports(path) for path in modules}


@pytest.mark.check
def test_every_module_sits_in_a_layer():
    assert {layer_of(module) for module in import_graph()} <= set(LAYERS)


@pytest.mark.check
def test_imports_point_down_only():
    upward = [
        f"{module} imports {target}"
        for module, targets in import_graph().items()
        for target in sorted(targets)
        if layer_of(target) not in CAN_IMPORT[layer_of(module)]
    ]
    assert not upward, "\n".join(upward)


@pytest.mark.check
def test_no_module_imports_itself_back():
    graph = import_graph()
    try:
        TopologicalSorter({module: targets & graph.keys() for module, targets in graph.items()}).prepare()
    except CycleError as exc:
        pytest.fail(f"an import circle: {' -> '.join(exc.args[1])}")


# The layers `--dry-run` and `--help` stand on: the heavy libraries (seconds to import, docs/development.md) are
# imported inside the functions that need them, never at a module's top.
LIGHT = ("common", "config", "run_folder")
HEAVY = ("torch", "transformers", "peft", "datasets", "accelerate", "bitsandbytes", "evaluate", "deepspeed")


@pytest.mark.check
def test_the_light_layers_import_no_heavy_library_at_the_top():
    heavy = []
    for layer in LIGHT:
        for path in sorted((REPO / "utils" / layer).rglob("*.py")):
            for node in ast.parse(path.read_text()).body:
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
                names += [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
                heavy += [f"{module_name(path)} imports {n}" for n in names if n.split(".")[0] in HEAVY]
    assert not heavy, "\n".join(heavy)


@pytest.mark.check
def test_the_layering_check_sees_an_upward_import(tmp_path, monkeypatch):
    """The check above can fail: a config module that imports training is reported."""
    (tmp_path / "utils" / "config").mkdir(parents=True)
    (tmp_path / "utils" / "config" / "plan.py").write_text("from utils.training.model import build_model\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    with pytest.raises(AssertionError, match="utils.config.plan imports utils.training.model"):
        test_imports_point_down_only()
