"""Every grid's committed results pages (benchmarks/results/<stem>.{json,md,png}) regenerate byte for byte from
the committed records alone, with the committed stamp (`--report-only --same-stamp`): the grids' shared code
(experiments/grid_driver.py and what the pages are rendered from) has not changed a reported number or word. No
training, no run folder."""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

import pytest

from helpers.grids import load_experiment

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"


# (script, the committed files it writes; the pages the grid reads besides its own)
GRIDS = {
    "replicate_cpu": ("replication_cpu", ["replication_cpu.json", "replication_cpu.md"]
                      + [p.name for p in sorted(RESULTS.glob("replication_cpu_*.png"))], []),
    "experts_vs_gate": ("experts_vs_gate", ["experts_vs_gate.json", "experts_vs_gate.md", "experts_vs_gate.png"], []),
    "routing_vs_projection": ("routing_vs_projection",
                              [p.name for p in sorted(RESULTS.glob("routing_vs_projection.*"))],
                              ["experts_vs_gate.json"]),
    "moeut_first_look": ("moeut_first_look", ["moeut_first_look.json", "moeut_first_look.md",
                                              "moeut_first_look.png"], []),
}


@pytest.mark.parametrize("script", sorted(GRIDS))
def test_committed_pages_regenerate_identically(script, tmp_path):
    stem, files, read = GRIDS[script]
    module = load_experiment(script)
    grid_driver = sys.modules["grid_driver"]
    assert f"{stem}.json" in files and f"{stem}.md" in files
    for name in files + read:
        shutil.copy(RESULTS / name, tmp_path / name)
    module.write_results(tmp_path / "out", tmp_path, **grid_driver.committed_stamp(tmp_path, stem))
    for name in files:
        assert (tmp_path / name).read_bytes() == (RESULTS / name).read_bytes(), name


def test_same_stamp_needs_a_committed_page(tmp_path):
    load_experiment("experts_vs_gate")
    with pytest.raises(SystemExit, match="does not exist"):
        sys.modules["grid_driver"].committed_stamp(tmp_path, "experts_vs_gate")


@pytest.mark.parametrize("script", sorted(GRIDS))
def test_every_image_a_page_links_is_committed(script):
    """A page that links its plot ships the plot: the docs site builds the results pages strictly."""
    stem, files, _ = GRIDS[script]
    linked = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", (RESULTS / f"{stem}.md").read_text())
    assert linked, f"{stem}.md links no plot"
    for name in linked:
        assert name in files and (RESULTS / name).is_file(), f"{stem}.md links {name}, which is not committed"
