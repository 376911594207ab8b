"""`switchhead <command> --help` is true and complete: every option says what it does, and every option a help
text names exists (on that command, or on the command the text names: `switchhead train --list-presets`)."""

import argparse
import re

from switchhead.cli import build_parser


def _commands(parser=None, prefix="") -> dict[str, argparse.ArgumentParser]:
    """Every (sub)command by its name after `switchhead`, nested ones ('convert to-authors') included."""
    found = {}
    for action in (parser or build_parser())._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found[prefix + name] = sub
                found.update(_commands(sub, f"{prefix}{name} "))
    return found


def test_every_option_of_every_command_has_help_text():
    missing = [f"{name} {action.option_strings or action.dest}" for name, parser in _commands().items()
               for action in parser._actions
               if not isinstance(action, (argparse._HelpAction, argparse._SubParsersAction))
               and not (action.help or "").strip()]
    assert missing == []


# options of other tools that our help texts name (Accelerate, lm-eval, vLLM), and one `train --help` says is absent
OTHER_TOOLS = {"--config_file", "--multi_gpu", "--include_path", "--max-model-len", "--max-num-seqs", "--pp-size"}


def test_every_option_a_help_text_names_exists(monkeypatch):
    monkeypatch.setenv("COLUMNS", "2000")  # no wrapping inside an option's name
    commands = _commands()
    ours = {o for parser in commands.values() for a in parser._actions for o in a.option_strings}
    wrong = []
    for name, parser in commands.items():
        own = {o for a in parser._actions for o in a.option_strings}
        for option in set(re.findall(r"(?<![\w-])--[a-z][a-z0-9_-]*[a-z0-9]", parser.format_help())):
            if option not in own and option not in ours and option not in OTHER_TOOLS:
                wrong.append(f"switchhead {name} --help names {option}, which no command has")
    assert wrong == []
