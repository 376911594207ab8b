"""Whether a command may run code stored in a model folder: `remote_code`, `check_remote_code`.

Transformers runs a folder's own Python files (an `auto_map` naming `file.Class`, a `custom_generate/generate.py`)
when `trust_remote_code=True`, and asks on stdin when it is left out (None). So the decision is made here, once, from
the user's `--trust-remote-code` alone: every command passes the bool this module returns to every `from_pretrained`
(never None: no prompt, whatever stdin holds), and a folder that asks for its own code is refused in one line
before anything is loaded unless the user opted in. Refused rather than loaded with Transformers' built-in classes:
a folder that names its own tokenizer or model class would otherwise be read by another one, silently.

Our own folders carry an `auto_map` in config.json (so that they load elsewhere with `trust_remote_code=True`), but
`import switchhead` registers the `switchhead` model type with the Auto classes: without the opt-in they load with
the installed package's code, and nothing from the folder runs.
"""

from __future__ import annotations

import json
import os

# files Transformers' Auto classes read an `auto_map` from (config.json is handled apart: see `remote_code`)
AUTO_MAP_FILES = ("tokenizer_config.json", "generation_config.json", "processor_config.json",
                  "preprocessor_config.json", "feature_extractor_config.json", "image_processor_config.json",
                  "video_preprocessor_config.json")
CUSTOM_GENERATE = os.path.join("custom_generate", "generate.py")


class RemoteCodeRefused(ValueError):
    """A folder that asks for its own code, loaded without `--trust-remote-code` (one line, exit code 2)."""


class SpecialFileRefused(ValueError):
    """A model folder holding a FIFO, a device or a socket (one line, exit code 2)."""


def check_entries(folder: str) -> None:
    """SpecialFileRefused when an entry of `folder` is (or links to) neither a regular file nor a folder: reading a
    FIFO blocks until someone writes to it, a device feeds bytes forever; Transformers and this module would read
    the config files among them without asking."""
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return  # the commands' own checks name a missing or unreadable folder
    for name in names:
        path = os.path.join(folder, name)
        if os.path.exists(path) and not os.path.isfile(path) and not os.path.isdir(path):
            raise SpecialFileRefused(f"model folder {folder!r} holds {name}, which is not a regular file (a FIFO, "
                                     "device or socket would hang or feed the load); remove it")


def _read_object(path: str) -> dict | None:
    """A JSON file's object, None where the file is absent; a file that is not a JSON object is left to the loader
    that reads it (which refuses it in its own words), except that its `auto_map` cannot be told: then {}."""
    if not os.path.lexists(path):
        return None
    try:
        with open(path, encoding="utf-8") as handle:
            value = json.load(handle)
    except (OSError, ValueError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}


def _locally_registered(model_type) -> bool:
    """Whether Transformers (with our model registered) has a config class of its own for `model_type`."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    import switchhead  # noqa: F401 - registers the switchhead model type

    return isinstance(model_type, str) and model_type in CONFIG_MAPPING


def _references(auto_map) -> list[str]:
    """The `file.Class` references of an `auto_map` ({Auto class: reference or [slow, fast]})."""
    if not isinstance(auto_map, dict):
        return [repr(auto_map)]
    found = []
    for value in auto_map.values():
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if item is not None:
                found.append(str(item))
    return found or [repr(auto_map)]


def remote_code(folder: str) -> list[str]:
    """What in `folder` would run the folder's own code under `trust_remote_code=True` ('FILE: reference'), []
    when nothing would. config.json's `auto_map` counts only where its `model_type` has no class of Transformers'
    or ours (else that class loads it without remote code); every other `auto_map`, and a custom generate function,
    counts."""
    found = []
    config = _read_object(os.path.join(folder, "config.json"))
    if config and "auto_map" in config:
        auto_map = config["auto_map"]
        if isinstance(auto_map, dict) and _locally_registered(config.get("model_type")):
            # the model and config classes are the registered ones; a tokenizer (or processor) class named here
            # is still the folder's own (AutoTokenizer reads config.json's auto_map too)
            auto_map = {key: value for key, value in auto_map.items()
                        if not (key == "AutoConfig" or str(key).startswith("AutoModel"))}
        if auto_map:
            found += [f"config.json: {reference}" for reference in _references(auto_map)]
    for name in AUTO_MAP_FILES:
        fields = _read_object(os.path.join(folder, name))
        if fields and "auto_map" in fields:
            found += [f"{name}: {reference}" for reference in _references(fields["auto_map"])]
    if os.path.lexists(os.path.join(folder, CUSTOM_GENERATE)):
        found.append(f"{CUSTOM_GENERATE}: a generate function")
    return found


def check_remote_code(folder: str, trust_remote_code: bool = False) -> bool:
    """The `trust_remote_code` value to pass to every Transformers call on `folder`: the user's opt-in as a bool
    (never None, which would prompt). A folder holding a FIFO, device or socket is refused first
    (`check_entries`). Without the opt-in, a folder that asks for its own code is refused
    (RemoteCodeRefused naming the first file and class) instead of being read by other classes or prompting."""
    if trust_remote_code is not True and trust_remote_code is not False:
        raise TypeError(f"trust_remote_code must be True or False, got {trust_remote_code!r}")
    if not os.path.isdir(folder):
        return trust_remote_code
    check_entries(folder)
    if trust_remote_code:
        return True
    found = remote_code(folder)
    if found:
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        raise RemoteCodeRefused(
            f"model folder {folder!r} asks to run its own code ({found[0]}{more}), which runs only with "
            "--trust-remote-code (generate, eval, export, serve): pass it only once you have read and trust those "
            "files")
    return False


__all__ = ["AUTO_MAP_FILES", "RemoteCodeRefused", "SpecialFileRefused", "check_entries", "check_remote_code",
           "remote_code"]
