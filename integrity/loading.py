"""The checks every command runs on a saved model folder before it loads it: `check_saved_model`.

`generate`, `eval`, `export`, `finetune`, `serve` and `upcycle` call it with the folder they were given; it reads
config.json and the safetensors headers, then each tensor once, and raises `UnloadableModel` (a ValueError: one
line, exit code 2) naming the first problem:

- the folder asks to run its own code (an `auto_map`, `switchhead.integrity.trust`) and the user did not pass
  `--trust-remote-code`; the bool it returns is what the command passes to every `from_pretrained`;
- the manifest does not verify (a training run's folder or one with `SHA256SUMS`; skipped with `verify=False`,
  the commands' `--no-verify`);
- no safetensors weights: only a pickled `pytorch_model.bin` / `.pt` (never unpickled here: it can run code), or
  no weights at all;
- which weights Transformers would load cannot be told for sure, or differ from what is checked: both
  model.safetensors and an index (Transformers reads the first, a user may mean the second), a LoRA adapter beside
  the model (Transformers applies it on load), a weight file that is not a regular file (a FIFO would hang the
  load), an index naming a shard outside the folder, a shard that is missing, a tensor in two shards or in a shard
  the index does not name for it; `transformers_weights` in config.json names the file, as Transformers reads it;
- config.json asks for more than the machine holds (`check_fits_memory`, computed from the config on the meta
  device before anything is allocated), or for more layers than the weights have;
- a tensor is missing, has another shape than config.json gives it, or is not one the model has (a checkpoint of
  more layers than config.json says: Transformers would drop the rest), or holds integers or booleans where the
  model has a floating-point tensor (Transformers would cast them);
- a sigma-MoE tensor is stored under both its old and its new name (`mlp.keys` and `mlp.experts.expert_keys`) with
  different values: which one is meant cannot be told;
- a weight is NaN or infinite (a bit flip, a diverged run saved by other code).

Folders of other model types (a GPT-2 folder given to `serve`) get the same checks where they apply.
"""

from __future__ import annotations

import copy
import json
import os
import re

from .manifest import check_model_folder
from .trust import check_remote_code

PICKLED_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "model.pth", "tf_model.h5",
                   "flax_model.msgpack")
LAYER_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class UnloadableModel(ValueError):
    """A saved model folder that a command refuses to load; the message names the folder and the problem."""


def physical_memory_bytes() -> int | None:
    """This machine's physical memory (None where the platform does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _gib(count: int | float) -> str:
    return f"{count / 2**30:,.1f} GiB" if count < 2**50 else f"{count / 2**30:.3g} GiB"


def check_fits_memory(needed: int | float, what: str) -> None:
    """UnloadableModel when `needed` bytes exceed this machine's physical memory; `what` says what needs them."""
    memory = physical_memory_bytes()
    if memory is not None and needed > memory:
        raise UnloadableModel(f"{what} needs {_gib(needed)}, more than this machine's {_gib(memory)} of memory; "
                              "make it smaller")


def meta_model(config, trust_remote_code: bool = False):
    """The model `config` describes (its saved architecture, else a causal LM), built on the meta device: shapes
    only, nothing allocated. `trust_remote_code` as the user decided (`switchhead.integrity.trust`)."""
    import torch
    import transformers

    import switchhead

    with torch.device("meta"):
        for name in getattr(config, "architectures", None) or ():
            model_class = getattr(switchhead, name, None) or getattr(transformers, name, None)
            if isinstance(model_class, type) and issubclass(model_class, transformers.PreTrainedModel):
                return model_class(config)
        return transformers.AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)


def parameter_count(config, trust_remote_code: bool = False) -> int:
    """Parameters of the model that `config` describes, counted on the meta device (nothing is allocated): the
    model with one and with two layers gives the cost of the rest and of one layer, so even a config of 10^6 layers
    costs two small meta models."""
    def count(layers: int) -> int:
        small = copy.deepcopy(config)
        small.num_hidden_layers = layers
        if getattr(small, "layer_group_size", None) is not None:
            small.layer_group_size = None  # MoEUT's shared layers: count the distinct blocks
        return sum(parameter.numel() for parameter in meta_model(small, trust_remote_code).parameters())

    layers = int(getattr(config, "layer_group_size", None) or config.num_hidden_layers)
    one = count(1)
    return one + (layers - 1) * (count(2) - one) if layers > 1 else one


def config_sizes(config) -> str:
    """The size fields of a config, for a message: 'hidden_size 64, num_hidden_layers 2, ...'."""
    names = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim"]
    if getattr(config, "attention_type", None) == "switchhead":
        names.append("num_attention_experts")
    names += ["num_mlp_experts", "mlp_expert_size"] if getattr(config, "mlp_type", None) == "sigma_moe" else \
        ["intermediate_size"]
    return ", ".join(f"{name} {getattr(config, name)}" for name in names if getattr(config, name, None) is not None)


def check_model_size(config, bytes_per_parameter: int = 4, what: str = "the model",
                     trust_remote_code: bool = False) -> int:
    """Refuse (UnloadableModel with the reason) a config whose parameters cannot fit this machine's memory, before
    anything is allocated; returns the parameter count. `bytes_per_parameter`: 4 to hold fp32 weights, 16 to train
    them with AdamW (weights, gradients, two moments)."""
    try:
        parameters = parameter_count(config, trust_remote_code)
    except (RuntimeError, OverflowError) as error:  # sizes past what a tensor's element count can hold
        raise UnloadableModel(f"{what} is too large to build ({config_sizes(config)}: {error}); make it "
                              "smaller") from None
    check_fits_memory(parameters * bytes_per_parameter,
                      f"{what} ({parameters:.3g} parameters: {config_sizes(config)})")
    return parameters


ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")
SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"


def _raw_config(folder: str) -> dict:
    """config.json as a dict ({} where it is not a readable JSON object: `read_config` refuses it then)."""
    try:
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as handle:
            value = json.load(handle)
    except (OSError, ValueError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}


def _plain_name(folder: str, name, what: str) -> str:
    """`name` when it is a file name inside `folder` (no folder part, not '..'), else UnloadableModel: Transformers
    joins it to the folder, so '../x' or an absolute path would load a file from elsewhere."""
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name \
            or os.path.isabs(name):
        raise UnloadableModel(f"model folder {folder!r}: {what} names {name!r}, which is not a file name inside the "
                              "folder; weights are read from the folder only")
    return name


def _regular_file(folder: str, name: str, what: str) -> None:
    """UnloadableModel unless `folder/name` is (or links to) a regular file: a FIFO or a device would hang or feed
    the load endlessly, a dangling link loads nothing."""
    path = os.path.join(folder, name)
    if not os.path.lexists(path):
        raise UnloadableModel(f"model folder {folder!r}: {what} {name} is missing")
    if not os.path.isfile(path):
        kind = "a folder" if os.path.isdir(path) else "a link to nothing" if not os.path.exists(path) else \
            "not a regular file"
        raise UnloadableModel(f"model folder {folder!r}: {what} {name} is {kind}; weights must be a regular "
                              ".safetensors file")


def _index_shards(folder: str, index: str) -> list[str]:
    """The shards `index` names (each a regular file in the folder), sorted."""
    try:
        with open(os.path.join(folder, index), encoding="utf-8") as handle:
            weight_map = json.load(handle)["weight_map"]
        if not isinstance(weight_map, dict) or not weight_map:
            raise TypeError("weight_map is not a non-empty object")
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as error:
        raise UnloadableModel(f"model folder {folder!r}: {index} is unreadable "
                              f"({type(error).__name__}: {error})") from None
    files = sorted({_plain_name(folder, name, index) for name in weight_map.values()})
    for name in files:
        if not name.endswith(".safetensors"):
            raise UnloadableModel(f"model folder {folder!r}: {index} names the shard {name!r}, which is not a "
                                  ".safetensors file")
        _regular_file(folder, name, f"the shard listed in {index},")
    return files


def weight_files(folder: str) -> list[str]:
    """The safetensors files Transformers loads from `folder`: `weight_source(folder)`'s files."""
    return weight_source(folder)[0]


def weight_source(folder: str) -> tuple[list[str], str | None]:
    """(the safetensors files Transformers' `from_pretrained` loads from a saved folder (sharded or not), in the order
    it picks them: config.json's `transformers_weights`, else model.safetensors, else the index's shards; the index
    read, or None). UnloadableModel where the folder has none (naming what it holds instead: pickled weights are
    never loaded, unpickling can run code stored in the file), or where what Transformers loads could differ from
    these files (see the module docstring)."""
    adapter = [name for name in ADAPTER_FILES if os.path.lexists(os.path.join(folder, name))]
    if adapter:
        raise UnloadableModel(f"model folder {folder!r} holds a LoRA adapter ({adapter[0]}) beside the model, which "
                              "Transformers would apply on load; load the model from a folder without the adapter, "
                              "or merge it (finetune --merge)")
    explicit = _raw_config(folder).get("transformers_weights")
    if explicit is not None:
        name = _plain_name(folder, explicit, "config.json's transformers_weights")
        if name.endswith(".safetensors.index.json"):
            return _index_shards(folder, name), name
        if not name.endswith(".safetensors"):
            raise UnloadableModel(f"model folder {folder!r}: config.json's transformers_weights {name!r} is not a "
                                  ".safetensors file")
        _regular_file(folder, name, "the weight file named by config.json's transformers_weights,")
        return [name], None
    single, index = (os.path.lexists(os.path.join(folder, name)) for name in (SAFE_WEIGHTS, SAFE_INDEX))
    if single and index:
        raise UnloadableModel(f"model folder {folder!r} holds both {SAFE_WEIGHTS} and {SAFE_INDEX}: Transformers "
                              f"loads {SAFE_WEIGHTS} and ignores the shards, which may not be what was meant; remove "
                              "one of them")
    if index:
        return _index_shards(folder, SAFE_INDEX), SAFE_INDEX
    if single:
        _regular_file(folder, SAFE_WEIGHTS, "the weight file")
        return [SAFE_WEIGHTS], None
    pickled = [name for name in PICKLED_WEIGHTS if os.path.isfile(os.path.join(folder, name))]
    if pickled:
        raise UnloadableModel(f"model folder {folder!r} holds its weights only as {pickled[0]}, a pickle, which is "
                              "never loaded here (unpickling can run code stored in the file); save the model with "
                              "safetensors (save_pretrained's default) from a source you trust")
    raise UnloadableModel(f"model folder {folder!r} has no model.safetensors (or model.safetensors.index.json): it "
                          "holds no weights; give a save_pretrained folder")


FLOAT_DTYPES = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "F8_E8M0", "F4", "F6_E2M3", "F6_E3M2"}


def _headers(folder: str, files: list[str], index: str | None = None
             ) -> tuple[dict[str, tuple[str, tuple[int, ...]]], dict[str, str]]:
    """({tensor name: (file, shape)}, {tensor name: safetensors dtype}) from the safetensors headers (nothing else
    is read). A file safetensors cannot open, a tensor in two files, or an index that does not name each tensor's
    file as the file that holds it is refused: which value Transformers would load could not be told."""
    from safetensors import safe_open

    tensors, dtypes = {}, {}
    for name in files:
        try:
            with safe_open(os.path.join(folder, name), framework="pt") as handle:
                for key in handle.keys():
                    if key in tensors:
                        raise UnloadableModel(f"model folder {folder!r}: {key} is stored in both {tensors[key][0]} "
                                              f"and {name}; which one is meant cannot be told")
                    piece = handle.get_slice(key)
                    tensors[key] = (name, tuple(piece.get_shape()))
                    dtypes[key] = str(piece.get_dtype())
        except UnloadableModel:
            raise
        except Exception as error:  # noqa: BLE001 - SafetensorError, OSError: a damaged or lying header
            if type(error).__name__ != "SafetensorError" and not isinstance(error, OSError):
                raise
            text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise UnloadableModel(f"model folder {folder!r}: {name} is not a readable .safetensors file "
                                  f"({text})") from None
    if index is not None:
        with open(os.path.join(folder, index), encoding="utf-8") as handle:
            weight_map = json.load(handle)["weight_map"]
        for key, file in sorted(weight_map.items()):
            if key not in tensors or tensors[key][0] != file:
                raise UnloadableModel(f"model folder {folder!r}: {index} puts {key} in {file}, which does not hold "
                                      "it; the index does not describe the shards")
        unlisted = sorted(set(tensors) - set(weight_map))
        if unlisted:
            raise UnloadableModel(f"model folder {folder!r}: {tensors[unlisted[0]][0]} holds {unlisted[0]}, which "
                                  f"{index} does not list; the index does not describe the shards")
    return tensors, dtypes


def _expected_tensors(config, trust_remote_code: bool = False):
    """({name: meta tensor} of what the model config.json describes saves (parameters and persistent buffers), the
    names a file may leave out (weights tied to another one), its base model's prefix, the patterns of saved names
    Transformers ignores on load), from a meta-device model."""
    model = meta_model(config, trust_remote_code)
    tied = set()
    if getattr(config, "tie_word_embeddings", False):
        tied.update(getattr(model, "_tied_weights_keys", None) or ())  # {tied name: its source} (a list before 5.0)
    ignored = [re.compile(pattern) for pattern in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()]
    return dict(model.state_dict()), tied, getattr(model, "base_model_prefix", ""), ignored


def _saved_names(config) -> dict[str, str]:
    """{name in a file: parameter name}: the renamings Transformers applies on load (the sigma-MoE tensors'
    names of earlier releases)."""
    if getattr(config, "model_type", None) != "switchhead":
        return {}
    from switchhead.checkpoint_format import RENAMED_KEYS

    return RENAMED_KEYS


def _rename(key: str, renamed: dict[str, str]) -> str:
    for old, new in renamed.items():
        if key.endswith(old):
            return key[: len(key) - len(old)] + new
    return key


def _layer_problem(config, tensors: dict[str, tuple[str, tuple[int, ...]]]) -> str | None:
    """config.json asking for another number of layers than the files hold (read from the names alone: no model is
    built), or for a number of layers that is not a positive whole number."""
    wanted = getattr(config, "num_hidden_layers", None)
    if wanted is not None and (not isinstance(wanted, int) or isinstance(wanted, bool) or wanted < 1):
        return f"config.json has num_hidden_layers {wanted!r}; it must be a whole number >= 1"
    saved = {int(match.group(1)) for key in tensors for match in [LAYER_KEY.search(key)] if match}
    if isinstance(wanted, int) and not isinstance(wanted, bool):
        wanted = getattr(config, "layer_group_size", None) or wanted  # MoEUT: one saved block per group member
    if saved and isinstance(wanted, int) and wanted != max(saved) + 1:
        return (f"config.json has num_hidden_layers {wanted}, but the weights hold {max(saved) + 1} layers; the "
                "weights do not belong to this config.json")
    return None


def weight_problem(config, tensors: dict[str, tuple[str, tuple[int, ...]]], dtypes: dict[str, str] | None = None,
                   trust_remote_code: bool = False) -> str | None:
    """The first way the tensors in the files ({name: (file, shape)}, {name: safetensors dtype}) do not fit
    `config` (a sentence), or None: another number of layers in config.json than in the files, a tensor missing,
    one the model does not have, a tensor of another shape, integers or booleans for a floating-point tensor (or
    the reverse). Builds the model on the meta device: check its size first (`check_model_size`)."""
    problem = _layer_problem(config, tensors)
    if problem is not None:
        return problem
    renamed = _saved_names(config)
    expected_tensors, tied, prefix, ignored = _expected_tensors(config, trust_remote_code)
    expected = {name: tuple(tensor.shape) for name, tensor in expected_tensors.items()}
    present = {_rename(key, renamed): (key, file, shape) for key, (file, shape) in tensors.items()}
    # a base model's folder (`h.0...`) read as its LM (`transformer.h.0...`), as Transformers reads it
    present.update({f"{prefix}.{name}": entry for name, entry in list(present.items())
                    if prefix and f"{prefix}.{name}" not in present})
    for name, want in expected.items():
        if name not in present:
            if name in tied:
                continue
            return (f"{name} is missing from the weights, but config.json's model has it; the weights do not belong "
                    "to this config.json")
        key, file, shape = present[name]
        if shape != want:
            return (f"{file}: {key} has shape {list(shape)}, but config.json makes it {list(want)}; the weights do "
                    "not belong to this config.json")
        stored = (dtypes or {}).get(key)
        if stored is not None and (stored in FLOAT_DTYPES) != expected_tensors[name].is_floating_point():
            return (f"{file}: {key} is stored as {stored}, but the model's {name} is "
                    f"{str(expected_tensors[name].dtype).replace('torch.', '')}; Transformers would cast it: refused "
                    "(the weights are damaged or not this model's)")
    for key, (file, _) in sorted(tensors.items()):
        name = _rename(key, renamed)
        if name in expected or (prefix and f"{prefix}.{name}" in expected) or \
                (prefix and name.startswith(f"{prefix}.") and name[len(prefix) + 1:] in expected):
            continue
        if any(pattern.search(key) for pattern in ignored):
            continue
        return (f"{file}: {key} is not a tensor of config.json's model; Transformers would drop it, so the weights "
                "do not belong to this config.json")
    return None


def _check_values(folder: str, config, tensors: dict[str, tuple[str, tuple[int, ...]]]) -> None:
    """Every tensor finite; no tensor stored under an old and a new name with different values."""
    import torch
    from safetensors import safe_open

    renamed = _saved_names(config)
    by_file: dict[str, list[str]] = {}
    for key, (file, _) in tensors.items():
        by_file.setdefault(file, []).append(key)
    for file, keys in sorted(by_file.items()):
        with safe_open(os.path.join(folder, file), framework="pt") as handle:
            for key in sorted(keys):
                tensor = handle.get_tensor(key)
                if tensor.is_floating_point() and tensor.element_size() == 1:  # float8: isfinite has no kernel
                    tensor = tensor.float()
                if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                    bad = int((~torch.isfinite(tensor)).sum())
                    raise UnloadableModel(f"model folder {folder!r}: {file}: {key} holds {bad} NaN or infinite "
                                          f"value{'s' if bad > 1 else ''}; the weights are damaged (restore them or "
                                          "use another checkpoint)")
                new = _rename(key, renamed)
                if new != key and new in tensors:
                    new_file = tensors[new][0]
                    if new_file == file:
                        other = handle.get_tensor(new)
                    else:
                        with safe_open(os.path.join(folder, new_file), framework="pt") as second:
                            other = second.get_tensor(new)
                    if other.shape != tensor.shape or not torch.equal(other, tensor):
                        raise UnloadableModel(
                            f"model folder {folder!r} holds {key} (the name earlier releases wrote) and {new} (today's "
                            "name) with different values; which one is meant cannot be told: remove one of them")


def read_config(folder: str, trust_remote_code: bool = False):
    """config.json of `folder` through AutoConfig (after `import switchhead`, which registers ours), as
    UnloadableModel on failure. `trust_remote_code` is passed as given (a bool: never a prompt)."""
    from transformers import AutoConfig

    import switchhead  # noqa: F401 - registers the config class

    try:
        return AutoConfig.from_pretrained(folder, trust_remote_code=bool(trust_remote_code))
    except (ValueError, TypeError, KeyError, OSError, RecursionError) as error:  # RecursionError: JSON nested deep
        text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UnloadableModel(f"model folder {folder!r}: config.json does not load ({text})") from None


def check_saved_model(folder: str, verify: bool = True, trust_remote_code: bool = False,
                      model_type: str | None = "switchhead") -> bool:
    """Refuse (UnloadableModel naming the problem) a saved model folder that should not be loaded; see the module
    docstring. Reads every tensor once; allocates no model. Returns the `trust_remote_code` bool to pass to every
    Transformers call on the folder (`switchhead.integrity.trust.check_remote_code`). `model_type`: the type the
    caller loads the folder as (another type Transformers builds is refused); None where any is read on purpose (a
    GPT-2 folder that `upcycle` converts)."""
    from .user_json import check_folder_json

    try:
        # JSON files Transformers would fail on with a traceback (a list, 10^5 levels), another model type
        check_folder_json(folder, expected_model_type=model_type)
        trust = check_remote_code(folder, trust_remote_code)
    except ValueError as error:
        raise UnloadableModel(str(error)) from None
    if verify:
        check_model_folder(folder)
    files, index = weight_source(folder)
    config = read_config(folder, trust)
    tensors, dtypes = _headers(folder, files, index)
    problem = _layer_problem(config, tensors)  # before any model is built: config.json may ask for 10^6 layers
    if problem is None and isinstance(getattr(config, "num_hidden_layers", None), int):
        check_model_size(config, what=f"the model of {folder!r}", trust_remote_code=trust)
        problem = weight_problem(config, tensors, dtypes, trust)
    if problem is not None:
        raise UnloadableModel(f"model folder {folder!r}: {problem}")
    _check_values(folder, config, tensors)
    return trust


def check_decoding_method(folder: str) -> None:
    """UnloadableModel when the folder's generation_config.json asks for a decoding method that Transformers no
    longer ships but downloads as Hub code (contrastive search, DoLa, group or constrained beam search): every
    generation would fail (HTTP 500 on every request of a server), or run code from the Hub."""
    if not os.path.isfile(os.path.join(folder, "generation_config.json")):
        return
    import warnings

    from transformers import GenerationConfig
    from transformers.generation.utils import GENERATION_MODES_MAPPING
    from transformers.utils import logging as transformers_logging

    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()  # its notices on these methods are said by the line below
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mode = GenerationConfig.from_pretrained(folder).get_generation_mode()
    except (ValueError, TypeError, OSError) as error:
        text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UnloadableModel(f"model folder {folder!r}: generation_config.json does not load ({text})") from None
    finally:
        transformers_logging.set_verbosity(verbosity)
    method = GENERATION_MODES_MAPPING.get(mode, "")
    if "/" in method:
        name = str(getattr(mode, "value", mode)).replace("_", " ")
        raise UnloadableModel(f"model folder {folder!r}: generation_config.json asks for {name}, which "
                              f"Transformers runs only as Hub code ({method}); set its "
                              "decoding options (penalty_alpha, dola_layers, num_beam_groups, constraints) back to "
                              "greedy or sampling")


def cached_snapshot(repo_id: str) -> str:
    """The folder of the local Hub cache that Transformers would load `repo_id` (owner/name) from offline: the
    snapshot its `main` ref names. UnloadableModel when the cache has none: a repository that is not in the local cache
    cannot be checked before it loads, so it is not downloaded behind the checks either."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return snapshot_download(repo_id, local_files_only=True)
    except LocalEntryNotFoundError:
        raise UnloadableModel(f"{repo_id!r} is neither a model folder nor a repository in the local Hub cache; "
                              f"download it first (`hf download {repo_id}`), so that its files are checked before "
                              "they load") from None
    except (HFValidationError, ValueError, OSError) as error:
        text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UnloadableModel(f"{repo_id!r} is not a usable Hub repository id ({text})") from None


def check_hub_model(repo_id: str, verify: bool = True, trust_remote_code: bool = False,
                    model_type: str | None = "switchhead") -> tuple[str, bool]:
    """`check_saved_model` for a Hub repository id, on the cached snapshot it resolves to (`cached_snapshot`): a
    cached repository gets exactly the checks a folder gets. Returns (the snapshot folder, the trust_remote_code
    bool); messages name the repository id. Load it offline afterwards (`hub_offline`), so that the files loaded
    are the ones checked and not a newer revision."""
    snapshot = cached_snapshot(repo_id)
    try:
        trust = check_saved_model(snapshot, verify=verify, trust_remote_code=trust_remote_code,
                                  model_type=model_type)
    except ValueError as error:  # UnloadableModel, the manifest's ValueError: the same line, naming the repository
        raise UnloadableModel(str(error).replace(repr(snapshot), f"{repo_id!r} (its cached snapshot)")
                              .replace(snapshot, repo_id)) from None
    return snapshot, trust


def hub_offline() -> None:
    """From now on this process (and a process it starts with its environment) loads from the local Hub cache only:
    after `check_hub_model`, Transformers then loads the snapshot that was checked."""
    import huggingface_hub.constants

    os.environ["HF_HUB_OFFLINE"] = "1"
    huggingface_hub.constants.HF_HUB_OFFLINE = True


__all__ = ["UnloadableModel", "cached_snapshot", "check_decoding_method", "check_fits_memory", "check_hub_model",
           "check_model_size", "check_saved_model", "hub_offline", "meta_model", "parameter_count",
           "physical_memory_bytes", "read_config", "weight_files", "weight_problem", "weight_source"]
