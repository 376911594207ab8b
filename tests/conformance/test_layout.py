"""The layout is the architecture: kernels <- model <- training / evaluation / conversion / serving / vllm <- cli.

Every import of `switchhead.<part>` (absolute, or relative inside a folder) is read from the source with `ast`, and
an import that points the wrong way fails the test with the file and line.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = {"modeling_switchhead": "model", "kernels": "kernels", "training": "training", "evaluation": "evaluation",
           "conversion": "conversion", "serving": "serving", "vllm_plugin": "vllm", "integrity": "integrity",
           "cli": "cli"}
# the part of `switchhead.<name>`: each folder's import name is its part's name (vllm_plugin/ -> switchhead.vllm)
PARTS = {part for part in FOLDERS.values() if part != "model"}
# what each part may import from switchhead (besides itself)
ALLOWED = {
    "kernels": set(),
    "model": {"kernels"},
    "integrity": {"model"},
    "training": {"model", "kernels", "integrity"},
    "evaluation": {"model", "kernels", "integrity"},
    "conversion": {"model", "kernels", "integrity"},
    "serving": {"model", "kernels", "integrity"},
    "vllm": {"model", "kernels"},
    "cli": {"model", "kernels", "integrity", "training", "evaluation", "conversion", "serving"},
}
MODEL_MODULES = {path.stem for path in (ROOT / "modeling_switchhead").glob("*.py")}


def part_of(module: str) -> str | None:
    """`switchhead.x.y` -> the part it belongs to (None: not ours)."""
    names = module.split(".")
    if names[0] != "switchhead":
        return None
    if len(names) == 1 or names[1] in MODEL_MODULES:
        return "model"
    return names[1] if names[1] in PARTS else "model"


def imports_of(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def test_imports_point_one_way():
    wrong = []
    for folder, part in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            for line, module in imports_of(path):
                target = part_of(module)
                if target is not None and target != part and target not in ALLOWED[part]:
                    wrong.append(f"{path.relative_to(ROOT)}:{line} ({part}) imports {module} ({target})")
    assert not wrong, "imports against the layout:\n" + "\n".join(wrong)


def test_the_checker_sees_a_wrong_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import os\nfrom switchhead.cli import main\nimport switchhead.training.trainer\n")
    assert [part_of(module) for _, module in imports_of(bad)] == [None, "cli", "training"]
