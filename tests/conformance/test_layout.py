"""The layout is the architecture: kernels <- model <- training / evaluation / conversion / serving / vllm <- cli.

Every import of `switchhead.<part>` (absolute, or relative inside a folder) is read from the source with `ast`, and
an import that points the wrong way fails the test with the file and line.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = {"modeling_switchhead": "model", "kernels": "kernels", "training": "training", "evaluation": "evaluation",
           "conversion": "conversion", "serving": "serving", "vllm_plugin": "vllm", "integrity": "integrity",
           "cli": "cli", "layers": "layers"}
# the part of `switchhead.<name>`: each folder's import name is its part's name (vllm_plugin/ -> switchhead.vllm)
PARTS = {part for part in FOLDERS.values() if part != "model"}
# what each part may import from switchhead (besides itself)
ALLOWED = {
    "kernels": set(),
    "model": {"kernels"},
    "integrity": {"model"},
    "training": {"model", "kernels", "integrity"},
    "evaluation": {"model", "kernels", "integrity"},
    "conversion": {"model", "kernels", "integrity", "layers"},
    "serving": {"model", "kernels", "integrity"},
    "vllm": {"model", "kernels"},
    "cli": {"model", "kernels", "integrity", "training", "evaluation", "conversion", "serving", "layers"},
    "layers": {"model", "kernels"},
}
# imports against the direction that are lazy by design: the top-level names of the drop-in layers
# (`switchhead.SwitchHeadRope`), imported by the package's `__getattr__` on first use
LAZY = {("modeling_switchhead/__init__.py", "switchhead.layers")}
MODEL_MODULES = {path.stem for path in (ROOT / "modeling_switchhead").glob("*.py")}


def part_of(module: str) -> str | None:
    """`switchhead.x.y` -> the part it belongs to (None: not ours)."""
    names = module.split(".")
    if names[0] != "switchhead":
        return None
    if len(names) == 1 or names[1] in MODEL_MODULES:
        return "model"
    return names[1] if names[1] in PARTS else "model"


def package_of(path: Path) -> str:
    """The import name of the package that holds `path` (modeling_switchhead/x.py -> switchhead,
    vllm_plugin/y/z.py -> switchhead.vllm.y), what a relative import in that file starts from."""
    relative = path.relative_to(ROOT)
    folder, inner = relative.parts[0], list(relative.parts[1:-1])
    part = "" if FOLDERS[folder] == "model" else f".{FOLDERS[folder]}"
    return ".".join([f"switchhead{part}", *inner])


def imports_of(path: Path, package: str | None = None) -> list[tuple[int, str]]:
    """Every import of the file as an absolute module name, relative ones (`from ..x import y`) resolved from
    `package` (default: the file's own); for `from <package> import name` each name is listed too, as it may be a
    module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                names = (package or package_of(path)).split(".")
                base = ".".join(names[: len(names) - node.level + 1] + ([node.module] if node.module else []))
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names if alias.name != "*"]
    return found


def string_imports_of(path: Path) -> list[tuple[int, str]]:
    """`importlib.import_module("...")` / `__import__("...")` calls with a constant name of ours."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            name = getattr(node.func, "attr", getattr(node.func, "id", None))
            target = node.args[0].value
            if name in ("import_module", "__import__") and isinstance(target, str) \
                    and (target.startswith(".") or part_of(target) is not None):
                found.append((node.lineno, target))
    return found


def test_imports_point_one_way():
    wrong = []
    for folder, part in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            for line, module in imports_of(path):
                target = part_of(module)
                if target is not None and target != part and target not in ALLOWED[part] \
                        and (str(path.relative_to(ROOT)), module) not in LAZY:
                    wrong.append(f"{path.relative_to(ROOT)}:{line} ({part}) imports {module} ({target})")
    assert not wrong, "imports against the layout:\n" + "\n".join(wrong)


def test_no_string_imports_of_our_modules():
    found = [f"{path.relative_to(ROOT)}:{line} imports {name!r} by name"
             for folder in FOLDERS for path in sorted((ROOT / folder).rglob("*.py"))
             for line, name in string_imports_of(path)]
    assert not found, "\n".join(found)


def test_the_checker_sees_a_wrong_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import os\nfrom switchhead.cli import main\nimport switchhead.training.trainer\n")
    assert [part_of(module) for _, module in imports_of(bad)] == [None, "cli", "cli", "training"]


def test_the_checker_resolves_relative_imports(tmp_path):
    assert package_of(ROOT / "kernels" / "cvmm.py") == "switchhead.kernels"
    assert package_of(ROOT / "modeling_switchhead" / "expert_ops.py") == "switchhead"
    assert package_of(ROOT / "evaluation" / "tasks" / "x.py") == "switchhead.evaluation.tasks"
    # a file of the kernels folder reaching the model and training by relative imports
    bad = tmp_path / "bad.py"
    bad.write_text("from .. import SwitchHeadConfig\nfrom ..training import trainer\nfrom . import cvmm\n")
    found = imports_of(bad, "switchhead.kernels")
    assert found == [(1, "switchhead"), (1, "switchhead.SwitchHeadConfig"), (2, "switchhead.training"),
                     (2, "switchhead.training.trainer"), (3, "switchhead.kernels"), (3, "switchhead.kernels.cvmm")]
    assert [part_of(module) for _, module in found] == ["model", "model", "training", "training", "kernels",
                                                        "kernels"]


def test_the_checker_sees_a_string_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import importlib\nimportlib.import_module('switchhead.kernels')\n__import__('os')\n")
    assert string_imports_of(bad) == [(2, "switchhead.kernels")]


def _import_from(folder: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    code = "import switchhead, switchhead.cli; from switchhead import SwitchHeadConfig; print(switchhead.__file__)"
    return subprocess.run([sys.executable, "-c", code], cwd=folder, capture_output=True, text=True, timeout=300,
                          env=env)


@pytest.mark.integration
def test_the_package_imports_from_the_folder_that_holds_a_checkout_named_switchhead(tmp_path):
    """A clone keeps the repository's name, so Python started beside it finds the folder `switchhead` first; the
    import is handed over to the installed package instead of an empty namespace package."""
    (tmp_path / "switchhead").symlink_to(ROOT, target_is_directory=True)
    result = _import_from(tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert Path(result.stdout.strip().splitlines()[-1]) == ROOT / "modeling_switchhead" / "__init__.py"


@pytest.mark.integration
def test_without_the_package_installed_the_shadowing_checkout_says_what_to_do(tmp_path):
    (tmp_path / "switchhead").symlink_to(ROOT, target_is_directory=True)
    # an interpreter that sees neither site-packages nor the editable install
    env = dict(os.environ, PYTHONNOUSERSITE="1")
    result = subprocess.run([sys.executable, "-S", "-c", "import switchhead"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=120, env=env)
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: the folder ") and "switchhead is not installed: run `pip install -e" in last


def _our_modules() -> dict[str, Path]:
    modules = {}
    for folder in FOLDERS:
        for path in (ROOT / folder).rglob("*.py"):
            package = package_of(path)
            modules[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return modules


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules of ours it imports anywhere in its file (`from .x import y` counts `x.y` where that is a
    module, else `x`; an import under `if TYPE_CHECKING:` counts too: it is a circle a reader has to follow)."""
    graph = {}
    for name, path in modules.items():
        package, targets = package_of(path), set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names if alias.name in modules}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    names = package.split(".")
                    base = ".".join(names[: len(names) - node.level + 1] + ([node.module] if node.module else []))
                for alias in node.names:
                    target = f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                    if target in modules:
                        targets.add(target)
        graph[name] = targets - {name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return found


def test_no_import_circles():
    found = circles(import_graph(_our_modules()))
    assert not found, "modules that import each other (directly or around a circle):\n" + "\n".join(
        " <-> ".join(group) for group in found)


def test_the_circle_finder_sees_a_circle_and_nothing_else():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set(), "c": {"b"}}) == []
