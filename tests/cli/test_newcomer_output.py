"""What a newcomer reads from the command line: every subcommand's --help describes it, and the demo's table says
what its times are (wall time on a busy machine reads like a speed result otherwise)."""

from __future__ import annotations

from switchhead.cli import build_parser
from switchhead.cli.demo import results_table


def test_every_subcommand_help_has_a_description():
    subcommands = build_parser()._subparsers._group_actions[0].choices
    missing = [name for name, parser in subcommands.items() if not (parser.description or "").strip()]
    assert not missing, f"--help without a description: {missing}"
    assert "greedy" in subcommands["generate"].description


def test_demo_table_shows_wall_and_cpu_minutes_and_says_neither_compares_speed():
    lines = results_table([("SwitchHead (H=2, E=5, k=2)", 2_900_000, 101.5, 1.2e6, 3.4e5, 3462.0, 1470.0),
                           ("Dense (H=8)", 2_900_000, 117.0, 2.7e6, 1.3e6, 1470.0, 1380.0)])
    header, switchhead, dense, note = lines
    assert header.split()[-4:] == ["wall", "min", "CPU", "min"]
    assert switchhead.split()[-2:] == ["57.7", "24.5"] and dense.split()[-2:] == ["24.5", "23.0"]
    assert "other work" in note and "Neither compares speed" in note
