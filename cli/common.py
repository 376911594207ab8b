"""What every `switchhead` subcommand shares: the error contract (`UsageError` / `CliError`, `fail`, `error_line`)
and the checks of output paths, devices and `--set FIELD=VALUE` options. The subcommand modules import it; the
package's `main` (cli/__init__.py) imports them, so none of them imports the package.
"""

from __future__ import annotations

import json
import os


class UsageError(Exception):
    """An expected failure (bad input, a damaged file, the Hub unreachable): `main` prints one line
    `switchhead <command>: error: <message>` on stderr, no traceback, and exits with `exit_code` (2)."""

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code


CliError = UsageError  # the name subcommands use: `raise CliError("what to change")` or `fail("...")`


def fail(message: str, exit_code: int = 2):
    """End the running subcommand with the one-line error contract: `fail("--foo must be >= 1")`."""
    raise UsageError(message, exit_code)


def first_process() -> bool:
    """True outside a launcher, and in the first of the processes a launcher (torchrun, `accelerate launch`)
    started: the one that reports errors and alone probes or writes shared folders."""
    return os.environ.get("RANK", "0") in ("0", "")


def error_line(command: str | None, message: object) -> str:
    """The one line of the error contract (first line of the message only)."""
    text = str(message).strip().splitlines()[0] if str(message).strip() else type(message).__name__
    return f"switchhead {command or ''}: error: {text}".replace("switchhead : ", "switchhead: ")


# the files of a saved model folder that no output may replace (its weights, configuration, tokenizer, code)
MODEL_FILES = ("config.json", "generation_config.json", "SHA256SUMS", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "vocab.json", "merges.txt", "chat_template.jinja", "adapter_config.json")
MODEL_FILE_ENDINGS = (".safetensors", ".bin", ".index.json", ".py", ".model", ".pt", ".pth")


def refuse_existing_output(path: str, overwrite: bool, option: str = "--overwrite", model: str | None = None) -> None:
    """Before writing the user-named file `path`: refuse a folder, a link, a FIFO or a device whatever `overwrite`
    says (`switchhead.integrity.check_target`), an existing file unless `overwrite`, and a file of the model
    folder `model` that the command reads (its weights, config, tokenizer or code) even with `overwrite`."""
    from switchhead.integrity import OutputError, check_target

    if os.path.isdir(path) and not os.path.islink(path):
        fail(f"output {path!r} is a folder; give a file path")
    try:
        check_target(path, overwrite, option)
    except OutputError as error:
        fail(str(error))
    name = os.path.basename(path)
    if model is not None and os.path.isfile(path) and os.path.isdir(model) and \
            os.path.samefile(os.path.dirname(os.path.abspath(path)), model) and \
            (name in MODEL_FILES or name.endswith(MODEL_FILE_ENDINGS)):
        fail(f"output {path!r} is a file of the model folder being read ({model}); choose another path")


def check_device(name: str) -> str:
    """A `--device` value that names a device this machine has ("cpu", "cuda", "cuda:1", "mps", ...), else a
    UsageError saying which exist (torch's own errors for `tpu:7` or a missing GPU are tracebacks)."""
    import torch

    try:
        device = torch.device(name)
    except (RuntimeError, ValueError, TypeError):
        device = None
    available = ["cpu"]
    if torch.cuda.is_available():
        available += ["cuda"] + [f"cuda:{index}" for index in range(torch.cuda.device_count())]
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        available.append("mps")
    if device is not None and device.type == "cpu":
        return name
    if device is not None and device.type == "cuda" and torch.cuda.is_available() and \
            (device.index is None or device.index < torch.cuda.device_count()):
        return name
    if device is not None and device.type == "mps" and "mps" in available:
        return name
    fail(f"--device {name!r} is not a device of this machine; choose one of {', '.join(available)}")


def config_field_names() -> list[str]:
    """Every field a SwitchHeadConfig accepts (its own, the inherited PreTrainedConfig ones, `rope_theta`)."""
    import dataclasses

    from switchhead import SwitchHeadConfig

    return sorted({f.name for f in dataclasses.fields(SwitchHeadConfig)} | {"rope_theta"})


def check_field_names(names, known: list[str], what: str = "--set field") -> None:
    """UsageError for the first unknown name, with the closest valid names suggested."""
    import difflib

    for name in names:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=3, cutoff=0.5)
            hint = f"; did you mean {' or '.join(close)}?" if close else "; see the SwitchHeadConfig fields"
            fail(f"unknown {what} {name!r}{hint}")


def parse_field_assignments(items: list[str], known: list[str] | None = None) -> dict:
    """`--set FIELD=VALUE` options -> {field: value}; values are JSON (numbers, booleans) or bare strings.
    FIELD must be one of `known` (default: the SwitchHeadConfig fields); a typo names the closest fields."""
    overrides = {}
    known = config_field_names() if known is None else known
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise UsageError(f"--set expects FIELD=VALUE, got {item!r}")
        check_field_names([name], known)
        try:
            overrides[name] = json.loads(value)
        except json.JSONDecodeError:
            overrides[name] = value  # a bare string such as --set position_encoding=xl
    return overrides


def module_docstring(name: str) -> str | None:
    """The docstring of module `name`, read from its source without running it (nor its package's __init__, which
    may import the model stack): for a --help that shows a module's documentation and answers at once."""
    import ast
    import importlib.machinery
    import importlib.util

    package, _, leaf = name.rpartition(".")
    parent = importlib.util.find_spec(package)  # imports the packages above `package` only
    spec = importlib.machinery.PathFinder.find_spec(leaf, parent.submodule_search_locations)
    with open(spec.origin, encoding="utf-8") as source:
        return ast.get_docstring(ast.parse(source.read()), clean=True)
