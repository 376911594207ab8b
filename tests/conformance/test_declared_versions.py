"""What setup.py declares is what is tested: the versions the test command installs satisfy every declared range,
and the documentation's table of supported versions states the declared ranges as setup.py has them."""

from __future__ import annotations

import re
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parents[2]
SETUP = (ROOT / "setup.py").read_text(encoding="utf-8")


def _declared(name: str) -> Requirement:
    """The requirement on `name` written in setup.py (install_requires or an extra; one of them names it)."""
    found = []
    for text in re.findall(r'"([A-Za-z0-9_.-]+[<>=!~][^"]*)"', SETUP):
        try:
            requirement = Requirement(text)
        except InvalidRequirement:  # an entry point or another string that is not a requirement
            continue
        if requirement.name == name:
            found.append(requirement)
    assert found, f"setup.py declares no version of {name}"
    return found[0]


def _installed_by_test_command() -> dict[str, str]:
    pins = re.findall(r'"([A-Za-z0-9_.-]+)==([^"]+)"', (ROOT / "scripts" / "test.sh").read_text(encoding="utf-8"))
    return dict(pins)


def test_the_test_command_installs_versions_inside_the_declared_ranges():
    pins = _installed_by_test_command()
    assert {"torch", "triton", "transformers"} <= set(pins), pins
    for name, version in pins.items():
        assert _declared(name).specifier.contains(version), f"{name}=={version} is outside {_declared(name)}"


def test_the_python_bound_is_the_tested_interpreter():
    bound = re.search(r'python_requires="([^"]+)"', SETUP).group(1)
    assert bound == ">=3.11"  # the suite runs on 3.11; on 3.10 the [test] extra cannot install


def test_the_test_extra_installs_what_the_test_command_needs():
    extra = re.search(r'"test": \[(.*?)\]', SETUP, flags=re.S).group(1)
    assert '"triton==' in extra  # the compatibility subset imports the GPU audit, which imports triton


def test_the_documented_ranges_are_the_declared_ones():
    table = (ROOT / "docs" / "index.md").read_text(encoding="utf-8")
    for name in ("torch", "triton", "transformers"):
        row = next(line for line in table.splitlines() if line.startswith(f"| {name} |"))
        declared_column = row.strip(" |").split("|")[-1]
        documented = SpecifierSet(re.search(r"`([^`]+)`", declared_column).group(1))
        assert documented == _declared(name).specifier, (name, row)
