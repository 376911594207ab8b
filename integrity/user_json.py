"""JSON files a user hands us (a model folder's config.json, tokenizer_config.json, generation_config.json, an
evaluation results file), read in one place: a file that is not JSON, is nested past `MAX_DEPTH`, or holds a list,
a string or a number where an object belongs is a ValueError naming the file, which the command line reports as
its one error line. Python's parser raised RecursionError on 100,000 nested brackets, and Transformers read a list
with `.get` (AttributeError): both were tracebacks.

    from switchhead.integrity.user_json import read_json_object, check_folder_json
    results = read_json_object("results.json", "evaluation results")
    check_folder_json("runs/wt2")   # before Transformers reads any of the folder's JSON files
"""

from __future__ import annotations

import json
import os

MAX_DEPTH = 100  # nesting depth of a user JSON file; Transformers' own files stay below 10
MAX_BYTES = 256 << 20  # a config or results file this large is no config (tokenizer.json is not read here)

# the JSON files of a model folder that Transformers reads as objects (tokenizer.json is parsed by `tokenizers`)
FOLDER_OBJECT_FILES = ("config.json", "generation_config.json", "tokenizer_config.json", "special_tokens_map.json",
                       "preprocessor_config.json", "processor_config.json", "adapter_config.json")

# what config.json may name as the weights' dtype (Transformers looks the name up on torch)
DTYPE_NAMES = ("auto", "float32", "float16", "bfloat16", "float64", "float", "half", "double")


def _depth(value) -> int:
    """Nesting depth of a parsed JSON value, without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        deepest = max(deepest, depth)
        if isinstance(item, dict):
            stack.extend((child, depth + 1) for child in item.values())
        elif isinstance(item, list):
            stack.extend((child, depth + 1) for child in item)
    return deepest


def read_json(path: str | os.PathLike, what: str | None = None):
    """The parsed JSON of `path`, or ValueError (FileNotFoundError when it does not exist) naming it: not UTF-8,
    not JSON, nested deeper than MAX_DEPTH, or larger than MAX_BYTES."""
    name = what or os.fspath(path)
    if os.path.getsize(path) > MAX_BYTES:
        raise ValueError(f"{name} is larger than {MAX_BYTES >> 20} MiB: not a JSON settings file")
    try:
        with open(path, encoding="utf-8") as handle:
            value = json.load(handle)
    except RecursionError:
        raise ValueError(f"{name} is nested too deeply to be read (at most {MAX_DEPTH} levels)") from None
    except UnicodeDecodeError as error:
        raise ValueError(f"{name} is not UTF-8 text (invalid byte at offset {error.start})") from None
    except ValueError as error:  # JSONDecodeError, an integer of more than 4300 digits
        raise ValueError(f"{name} is not valid JSON ({str(error).splitlines()[0][:120]})") from None
    if _depth(value) > MAX_DEPTH:
        raise ValueError(f"{name} is nested too deeply to be read (at most {MAX_DEPTH} levels)")
    return value


def read_json_object(path: str | os.PathLike, what: str | None = None) -> dict:
    """`read_json` of a file that must hold one JSON object (a dict), else ValueError naming what it holds."""
    value = read_json(path, what)
    if not isinstance(value, dict):
        kind = {list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(type(value), "a number")
        raise ValueError(f"{what or os.fspath(path)} must hold a JSON object, but holds {kind}")
    return value


def check_folder_json(folder: str | os.PathLike, expected_model_type: str | None = "switchhead") -> None:
    """ValueError naming the first JSON file of a model folder that Transformers would fail on with a traceback:
    not an object (or not JSON, or too deep); in config.json, a `dtype` / `torch_dtype` that is no floating-point
    torch dtype ("float1"), and, with `expected_model_type`, another `model_type` that Transformers itself builds
    (`"llama"` over SwitchHead weights built a Llama model that failed on our fields; a type Transformers does not
    know is left to the remote-code decision)."""
    folder = os.fspath(folder)
    for name in FOLDER_OBJECT_FILES:
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            read_json_object(path, f"{name} of {folder!r}")
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        return
    config = read_json_object(path, f"config.json of {folder!r}")
    for key in ("dtype", "torch_dtype"):
        value = config.get(key)
        if value is not None and value not in DTYPE_NAMES:
            raise ValueError(f"config.json of {folder!r}: {key} {value!r} is not a floating-point dtype; use one of "
                             f"{', '.join(DTYPE_NAMES)}")
    model_type = config.get("model_type")
    if expected_model_type is not None and model_type != expected_model_type and _is_transformers_type(model_type):
        raise ValueError(f"config.json of {folder!r}: model_type {model_type!r} is not a SwitchHead model "
                         f"(expected {expected_model_type!r})")


def _is_transformers_type(model_type) -> bool:
    if not isinstance(model_type, str):
        return model_type is not None
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return model_type in CONFIG_MAPPING_NAMES


__all__ = ["MAX_DEPTH", "check_folder_json", "read_json", "read_json_object"]
