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
    with open(path, "rb") as handle:
        return parse_json(handle.read(), name)


def parse_json(data: bytes, name: str):
    """`read_json` of bytes already read (e.g. from a descriptor that is then uploaded): the same checks, naming
    `name`."""
    if len(data) > MAX_BYTES:
        raise ValueError(f"{name} is larger than {MAX_BYTES >> 20} MiB: not a JSON settings file")
    try:
        value = json.loads(data.decode("utf-8"))
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
    return _json_object(read_json(path, what), what or os.fspath(path))


def parse_json_object(data: bytes, name: str) -> dict:
    """`parse_json` of bytes that must hold one JSON object (a dict)."""
    return _json_object(parse_json(data, name), name)


def _json_object(value, name: str) -> dict:
    if not isinstance(value, dict):
        kind = {list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(type(value), "a number")
        raise ValueError(f"{name} must hold a JSON object, but holds {kind}")
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
    check_config_numbers(config, f"config.json of {folder!r}")
    _check_architectures(config, f"config.json of {folder!r}")
    generation = os.path.join(folder, "generation_config.json")
    generation = read_json_object(generation, f"generation_config.json of {folder!r}") \
        if os.path.isfile(generation) else {}
    vocab = config.get("vocab_size")
    # a foreign model handed to a converter (upcycle's GPT-2, whose config defaults its special tokens to 50256 for
    # any vocabulary) keeps its ids: the converter maps them, dropping those outside the vocabulary
    foreign = expected_model_type not in (None, "switchhead")
    for source, fields, name in ((config, TOKEN_ID_FIELDS, "config.json"),
                                 (generation, TOKEN_ID_FIELDS, "generation_config.json")):
        for field in fields if not foreign else ():
            _check_token_ids(source.get(field), vocab, f"{name} of {folder!r}: {field}")
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            _check_special_tokens(read_json_object(path, f"{name} of {folder!r}"), f"{name} of {folder!r}")


# token ids a config or generation config may give: each must be a token of the vocabulary (Transformers indexes
# the logits with them, an IndexError in the middle of generation)
TOKEN_ID_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id", "forced_bos_token_id", "forced_eos_token_id",
                   "decoder_start_token_id")
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
LARGEST_INTEGER = 2**63 - 1  # torch sizes and indices are 64-bit


def _check_token_ids(value, vocab, what: str) -> None:
    if value is None:
        return
    for token in value if isinstance(value, list) else [value]:
        if not isinstance(token, int) or isinstance(token, bool):
            raise ValueError(f"{what} is {token!r}, not a token id (a whole number)")
        if token < 0 or (isinstance(vocab, int) and not isinstance(vocab, bool) and 0 < vocab <= token):
            raise ValueError(f"{what} {token} is not a token of the vocabulary (0 to "
                             f"{vocab - 1 if isinstance(vocab, int) else '?'})")


def _check_special_tokens(tokenizer_config: dict, what: str) -> None:
    """Each special token a string, or an added-token object with a string `content` (Transformers raised a
    TypeError on anything else)."""
    def check(value, where: str) -> None:
        if value is None or isinstance(value, str):
            return
        if isinstance(value, dict) and isinstance(value.get("content"), str):
            return
        raise ValueError(f"{what}: {where} is {json.dumps(value)[:60]}, not a token (a string, or an object with a "
                         "string 'content')")

    for name in SPECIAL_TOKENS:
        check(tokenizer_config.get(name), name)
    extra = tokenizer_config.get("additional_special_tokens")
    if extra is not None:
        if not isinstance(extra, list):
            raise ValueError(f"{what}: additional_special_tokens is {type(extra).__name__}, not a list of tokens")
        for index, value in enumerate(extra):
            check(value, f"additional_special_tokens[{index}]")


def check_config_numbers(fields: dict, what: str) -> None:
    """ValueError naming the first whole number in a config (at any depth) past what a 64-bit integer holds: a
    401-digit hidden_size ended in OverflowError or in a TypeError from torch."""
    stack = [(key, value) for key, value in fields.items()]
    while stack:
        key, value = stack.pop()
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > LARGEST_INTEGER:
            digits = len(str(abs(value)))
            raise ValueError(f"{what}: {key} is a {digits}-digit number, past what a 64-bit integer holds; give a "
                             "real size")
        if isinstance(value, dict):
            stack.extend((f"{key}.{child}", item) for child, item in value.items())
        elif isinstance(value, list):
            stack.extend((f"{key}[{index}]", item) for index, item in enumerate(value))


def _check_architectures(config: dict, what: str) -> None:
    """config.json's `architectures` naming a Transformers class of another model type ("LlamaForCausalLM" over
    a switchhead config): the model would be built as that class from our fields (AttributeError)."""
    architectures = config.get("architectures")
    if architectures is None:
        return
    if not isinstance(architectures, list) or not all(isinstance(name, str) for name in architectures):
        raise ValueError(f"{what}: architectures must be a list of class names, got {json.dumps(architectures)[:60]}")
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or (model_type != "switchhead" and not _is_transformers_type(model_type)):
        return  # a type Transformers does not know is the remote-code decision's (`switchhead.integrity.trust`)
    import transformers

    for name in architectures:
        if name.startswith("SwitchHead"):
            other = None if model_type == "switchhead" else "switchhead"
        else:
            try:
                model_class = getattr(transformers, name, None)
            except Exception:  # noqa: BLE001 - a lazy module that fails to import: not a class of this type
                model_class = None
            other = getattr(getattr(model_class, "config_class", None), "model_type", None)
        if other and other != model_type:
            raise ValueError(f"{what}: architectures names {name}, a {other!r} model, but model_type is "
                             f"{model_type!r}; the weights would be loaded into the wrong class (fix architectures)")


def _is_transformers_type(model_type) -> bool:
    if not isinstance(model_type, str):
        return model_type is not None
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return model_type in CONFIG_MAPPING_NAMES


__all__ = ["MAX_DEPTH", "check_config_numbers", "check_folder_json", "read_json", "read_json_object"]
