"""The `switchhead` package laid out as it installs, from this checkout, without installing it.

setup.py maps the import names to folders (`switchhead` <- modeling_switchhead/, `switchhead.<name>` <- each folder
of its SUBPACKAGES). `link_tree(dest)` builds that layout under `dest/switchhead` as symbolic links, read from
setup.py without running it: the docs build reads the API from it (docs/_hooks/build.py), and the GPU machine, which
has no pip, imports the package from it (scripts/gpu/gpu_run.sh).

    python3 scripts/package_tree.py DEST     # prints the linked subpackages, one `name=folder` each
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def subpackages(repo: Path = REPO) -> dict[str, str]:
    """setup.py's SUBPACKAGES (import name under switchhead -> folder), read without running setup.py."""
    tree = ast.parse((repo / "setup.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "SUBPACKAGES" for t in node.targets):
            return ast.literal_eval(node.value)
    raise RuntimeError("setup.py has no SUBPACKAGES mapping")


def link_tree(dest: str | Path, repo: Path = REPO) -> dict[str, str]:
    """Create `dest/switchhead`: links to modeling_switchhead's .py files and to each subpackage folder that exists
    (one with an `__init__.py`, as setup.py installs it); returns the linked subpackages."""
    package = Path(dest) / "switchhead"
    package.mkdir(parents=True)
    for entry in (repo / "modeling_switchhead").iterdir():
        if entry.suffix == ".py":
            (package / entry.name).symlink_to(entry)
    linked = {}
    for name, folder in subpackages(repo).items():
        if (repo / folder / "__init__.py").is_file():
            (package / name).symlink_to(repo / folder, target_is_directory=True)
            linked[name] = folder
    return linked


if __name__ == "__main__":
    print("\n".join(f"{name}={folder}" for name, folder in link_tree(sys.argv[1]).items()))
