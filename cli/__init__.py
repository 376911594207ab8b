"""switchhead.cli: the `switchhead` command line, one entry point, one subcommand per job.

    switchhead COMMAND --help          # the console script
    python -m switchhead.cli COMMAND   # the same (what `accelerate launch -m switchhead.cli train` runs)

One module per command group registers its subcommands with `register(subparsers)`: `train`, `finetune`,
`evaluate` (eval, flops, card, publish), `convert` (convert, upcycle), `generate`, `serve`, `export`. Each handler
checks its arguments, calls the application package (switchhead.training, .evaluation, .conversion, .serving) and
returns an exit code. This package sits on top: it imports them, none of them imports it.

The error contract: bad input ends with exit code 2 and one line `switchhead <command>: error: <reason>` on
stderr (`fail(...)` or `raise CliError(...)`, and the expected exceptions of `expected_errors`); anything else
keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

from .common import (  # noqa: F401  (the shared helpers, also under this package's name)
    MODEL_FILE_ENDINGS,
    MODEL_FILES,
    CliError,
    UsageError,
    check_device,
    check_field_names,
    config_field_names,
    error_line,
    fail,
    first_process,
    parse_field_assignments,
    refuse_existing_output,
)


class ArgumentParser(argparse.ArgumentParser):
    """argparse with the one-line error contract: `switchhead <command>: error: ...`, exit 2 (no usage dump)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="switchhead", description="SwitchHead / SwitchAll models: train, "
                                     "evaluate, convert, generate, count MACs and publish.")
    from switchhead import __version__

    parser.add_argument("--version", action="version", version=f"switchhead {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    from . import convert, evaluate, export, finetune, generate, serve, train  # each imports its part when run

    commands = ((train, "switchhead.training"), (evaluate, "switchhead.evaluation"), (convert, "switchhead.conversion"),
                (generate, "switchhead"), (serve, "switchhead.serving"), (finetune, "switchhead.training"),
                (export, "switchhead.conversion"))
    for command, needs in commands:
        if importlib.util.find_spec(needs) is None:  # that part of the package is not installed
            continue
        command.register(subparsers)
    return parser


class _LibraryNoise:
    """Other libraries' messages that are not about the user's command, dropped from our commands' stderr (logger
    name -> the start of the message). Each comes before our own one-line error when it shows at all:
    bitsandbytes failing to fetch an optional CPU kernel from the Hub at import (finetune imports it through PEFT);
    Transformers warning that a config of another model type is read as ours (our own check names the problem)."""

    MESSAGES = {"bitsandbytes.backends.cpu.ops": "Failed to load CPU gemm_4bit_forward",
                "transformers.configuration_utils": "You are using a model of type",
                # a long --prompt or perplexity text: our own check names the model's length
                "transformers.tokenization_utils_base": "Token indices sequence length",
                # export: an ONNX table entry for torchvision ops, whose absence changes nothing for our model
                "torch.onnx._internal.exporter._registration": "torchvision is not installed"}

    def filter(self, record) -> bool:
        start = self.MESSAGES.get(record.name)
        return start is None or not record.getMessage().startswith(start)


_NOISE = _LibraryNoise()  # one instance: installing it again adds nothing


def quiet_library_noise() -> None:
    """Install the filters of `_LibraryNoise`, and drop torch's warning that a pickle of another protocol is read
    by its restricted loader (the file is refused or loaded all the same; a planted pickle triggers it)."""
    import logging
    import warnings

    for name in _LibraryNoise.MESSAGES:
        logging.getLogger(name).addFilter(_NOISE)
    warnings.filterwarnings("ignore", message=r"Detected pickle protocol \d+ in the checkpoint", category=UserWarning)
    # Transformers' deprecation notices are about its API, not the user's command, and came before the error line
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"(transformers|huggingface_hub)(\.|$)")
    # Transformers' "Loading weights" / "Writing model shards" bars (and the Hub's download bars) came before the
    # one error line of a failure after loading; our own progress bars (train, eval) are unaffected
    if os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1") == "1" and "transformers" in sys.modules:
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()


def undecodable_argument(argv: list[str]) -> str | None:
    """The error message for the first argument that is not valid UTF-8 (Python keeps such bytes as lone
    surrogates, which fail later wherever the text is written or encoded), else None."""
    for index, item in enumerate(argv):
        try:
            item.encode("utf-8")
        except UnicodeEncodeError:
            shown = os.fsencode(item)[:60]
            return f"argument {index + 1} ({shown!r}) is not valid UTF-8; rename the file or pass a UTF-8 path"
    return None


def flush_stdout() -> None:
    """Write out what the command printed; a full or closed stdout (`> /dev/full`) is a UsageError, and stdout is
    pointed at the null device so that the interpreter's own flush at exit does not report it a second time."""
    try:
        sys.stdout.flush()
    except OSError as error:
        try:
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, sys.stdout.fileno())
            os.close(null)
            sys.stdout.flush()
        except (OSError, ValueError):
            pass
        raise UsageError(f"cannot write the output to stdout: {error.strerror or error}") from None


def main(argv: list[str] | None = None) -> int:
    quiet_library_noise()
    undecodable = undecodable_argument(list(sys.argv[1:] if argv is None else argv))
    if undecodable is not None:
        first = (sys.argv[1:] if argv is None else argv)[:1]
        command = first[0] if first and undecodable_argument(first) is None and not first[0].startswith("-") else None
        print(error_line(command, undecodable), file=sys.stderr)
        return 2
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # for a subcommand that relaunches itself
    if extra:  # name the subcommand in the one-line error, as for its other argument errors
        choices = parser._subparsers._group_actions[0].choices if parser._subparsers else {}
        (choices.get(getattr(args, "command", None)) or parser).error(f"unrecognized arguments: {' '.join(extra)}")
    if not getattr(args, "handler", None):
        parser.print_help()
        return 2
    previous = _raise_on_stop_signals()
    try:
        code = int(args.handler(args) or 0)
        _raise_a_swallowed_stop()
        flush_stdout()
        return code
    except UsageError as error:
        report(error_line(args.command, error))
        return error.exit_code
    except KeyboardInterrupt as error:  # Ctrl-C, or SIGTERM (`Terminated`): every writer has cleaned up
        from switchhead.integrity import Terminated

        detail = f" ({str(error).strip().splitlines()[0]})" if str(error).strip() else ""
        print(f"switchhead {args.command}: {'terminated' if isinstance(error, Terminated) else 'interrupted'}"
              f"{detail}", file=sys.stderr)
        return 143 if isinstance(error, Terminated) else 130
    except Exception as error:
        message = describe_failure(error)
        if message is None:
            raise
        report(error_line(args.command, message))
        return 2
    finally:
        import signal

        from switchhead.integrity import clear_stops

        for number, handler in previous.items():
            signal.signal(number, handler)
        clear_stops()


def _raise_on_stop_signals() -> dict:
    """For the command's run, Ctrl-C raises KeyboardInterrupt and SIGTERM raises `Terminated` (a KeyboardInterrupt)
    in the main thread, each recorded first (`switchhead.integrity.record_stop`), so that what cleans up after Ctrl-C
    (temporary files, a training run's checkpoint) runs for a kill too, and a writer publishes nothing after a stop
    that a library caught. Returns {signal: handler to restore} for the handlers installed (none outside the main
    thread, or where someone else installed a handler)."""
    import signal
    import threading

    from switchhead.integrity import Terminated, record_stop

    if threading.current_thread() is not threading.main_thread():
        return {}

    def stop(number, frame):
        error = Terminated() if number == signal.SIGTERM else KeyboardInterrupt()
        record_stop(error)
        raise error

    import switchhead

    previous = {}
    for number, default in ((signal.SIGINT, signal.default_int_handler), (signal.SIGTERM, signal.SIG_DFL)):
        # the package's own handler for the seconds of its import counts as the default
        if signal.getsignal(number) in (default, getattr(switchhead, "_early_stop", None)):
            previous[number] = signal.signal(number, stop)
    return previous


def _raise_a_swallowed_stop() -> None:
    """A command that returned although it was asked to stop (a library caught the exception) ends as stopped."""
    from switchhead.integrity import raise_if_stopped

    raise_if_stopped()


def report(line: str) -> None:
    """The error line on stderr, from the first process only when a launcher (torchrun, `accelerate launch`) started
    several: each runs the same command and meets the same error, and the user should read it once. (The launcher
    then adds its own report of the failed processes.)"""
    if first_process():
        print(line, file=sys.stderr)


def expected_errors() -> tuple[type[BaseException], ...]:
    """Failures caused by the user's input or environment rather than a bug: one line, exit 2. Anything else
    keeps its traceback."""
    kinds: list[type[BaseException]] = [ValueError, FileNotFoundError, FileExistsError, NotADirectoryError,
                                        IsADirectoryError, PermissionError]
    try:
        from safetensors import SafetensorError

        kinds.append(SafetensorError)
    except ImportError:
        pass
    try:
        from huggingface_hub.errors import OfflineModeIsEnabled

        kinds.append(OfflineModeIsEnabled)
    except ImportError:
        pass
    return tuple(kinds)


def describe_failure(error: BaseException) -> str | None:
    """The one line for a failure that is not a bug (a write the disk refused, bad input), else None. Every failed
    write of an output ends here: `cannot write PATH: <strerror>`, whichever command met it."""
    from switchhead.integrity.files import DISK_ERRNOS, WriteError

    if isinstance(error, WriteError) or (isinstance(error, OSError) and error.errno in DISK_ERRNOS):
        where = f" {error.filename}" if error.filename else ""
        return f"cannot write{where}: {error.strerror or os.strerror(error.errno)}"
    if isinstance(error, expected_errors()):
        return describe_expected(error)
    return None


def describe_expected(error: BaseException) -> str:
    """The user-facing sentence for an expected failure."""
    name = type(error).__name__
    if name == "SafetensorError":
        return f"damaged or unreadable .safetensors file ({error})"
    if name == "OfflineModeIsEnabled":
        return "the Hugging Face Hub cannot be reached: HF_HUB_OFFLINE is set (unset it to publish or download)"
    if isinstance(error, OSError) and error.filename and str(error.filename) not in str(error.strerror or ""):
        return f"{error.strerror or name}: {error.filename!r}"
    return str(error) or name
