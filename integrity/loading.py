"""The checks every command runs on a saved model folder before it loads it: `check_saved_model`.

`generate`, `eval`, `export`, `finetune`, `serve` and `upcycle` call it with the folder they were given; it reads
config.json and the safetensors headers, then each tensor once, and raises `UnloadableModel` (a ValueError: one
line, exit code 2) naming the first problem:

- the manifest does not verify (a training run's folder or one with `SHA256SUMS`; skipped with `verify=False`,
  the commands' `--no-verify`);
- no safetensors weights: only a pickled `pytorch_model.bin` / `.pt` (never unpickled here: it can run code), or
  no weights at all;
- config.json asks for more than the machine holds (`check_fits_memory`, computed from the config on the meta
  device before anything is allocated), or for more layers than the weights have;
- a tensor is missing or has another shape than config.json gives it;
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


def meta_model(config):
    """The model `config` describes (its saved architecture, else a causal LM), built on the meta device: shapes
    only, nothing allocated."""
    import torch
    import transformers

    import switchhead

    with torch.device("meta"):
        for name in getattr(config, "architectures", None) or ():
            model_class = getattr(switchhead, name, None) or getattr(transformers, name, None)
            if isinstance(model_class, type) and issubclass(model_class, transformers.PreTrainedModel):
                return model_class(config)
        return transformers.AutoModelForCausalLM.from_config(config)


def parameter_count(config) -> int:
    """Parameters of the model that `config` describes, counted on the meta device (nothing is allocated): the
    model with one and with two layers gives the cost of the rest and of one layer, so even a config of 10^6 layers
    costs two small meta models."""
    def count(layers: int) -> int:
        small = copy.deepcopy(config)
        small.num_hidden_layers = layers
        return sum(parameter.numel() for parameter in meta_model(small).parameters())

    layers = int(config.num_hidden_layers)
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


def check_model_size(config, bytes_per_parameter: int = 4, what: str = "the model") -> int:
    """Refuse (UnloadableModel with the reason) a config whose parameters cannot fit this machine's memory, before
    anything is allocated; returns the parameter count. `bytes_per_parameter`: 4 to hold fp32 weights, 16 to train
    them with AdamW (weights, gradients, two moments)."""
    try:
        parameters = parameter_count(config)
    except (RuntimeError, OverflowError) as error:  # sizes past what a tensor's element count can hold
        raise UnloadableModel(f"{what} is too large to build ({config_sizes(config)}: {error}); make it "
                              "smaller") from None
    check_fits_memory(parameters * bytes_per_parameter,
                      f"{what} ({parameters:.3g} parameters: {config_sizes(config)})")
    return parameters


def weight_files(folder: str) -> list[str]:
    """The safetensors files of a saved folder (sharded or not); UnloadableModel when it has none, naming what it
    holds instead (pickled weights are never loaded: unpickling can run code stored in the file)."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as handle:
                files = sorted(set(json.load(handle)["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            raise UnloadableModel(f"model folder {folder!r}: model.safetensors.index.json is unreadable "
                                  f"({type(error).__name__}: {error})") from None
        missing = [name for name in files if not os.path.isfile(os.path.join(folder, name))]
        if missing:
            raise UnloadableModel(f"model folder {folder!r}: the shard {missing[0]} listed in "
                                  "model.safetensors.index.json is missing")
        return files
    if os.path.isfile(os.path.join(folder, "model.safetensors")):
        return ["model.safetensors"]
    pickled = [name for name in PICKLED_WEIGHTS if os.path.isfile(os.path.join(folder, name))]
    if pickled:
        raise UnloadableModel(f"model folder {folder!r} holds its weights only as {pickled[0]}, a pickle, which is "
                              "never loaded here (unpickling can run code stored in the file); save the model with "
                              "safetensors (save_pretrained's default) from a source you trust")
    raise UnloadableModel(f"model folder {folder!r} has no model.safetensors (or model.safetensors.index.json): it "
                          "holds no weights; give a save_pretrained folder")


def _headers(folder: str, files: list[str]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{tensor name: (file, shape)} from the safetensors headers (nothing else is read)."""
    from safetensors import safe_open

    tensors = {}
    for name in files:
        with safe_open(os.path.join(folder, name), framework="pt") as handle:
            for key in handle.keys():
                tensors[key] = (name, tuple(handle.get_slice(key).get_shape()))
    return tensors


def _expected_shapes(config) -> tuple[dict[str, tuple[int, ...]], set[str], str]:
    """({name: shape} of what the model config.json describes saves (parameters and persistent buffers), the names
    a file may leave out (weights tied to another one), its base model's prefix), from a meta-device model."""
    model = meta_model(config)
    tied = set()
    if getattr(config, "tie_word_embeddings", False):
        tied.update(getattr(model, "_tied_weights_keys", None) or ())  # {tied name: its source} (a list before 5.0)
    return ({name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}, tied,
            getattr(model, "base_model_prefix", ""))


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
    """config.json asking for more layers than the files hold (read from the names alone: no model is built)."""
    saved = {int(match.group(1)) for key in tensors for match in [LAYER_KEY.search(key)] if match}
    wanted = getattr(config, "num_hidden_layers", None)
    if saved and isinstance(wanted, int) and wanted > max(saved) + 1:
        return (f"config.json has num_hidden_layers {wanted}, but the weights hold {max(saved) + 1} layers; the "
                "weights do not belong to this config.json")
    return None


def weight_problem(config, tensors: dict[str, tuple[str, tuple[int, ...]]]) -> str | None:
    """The first way the tensors in the files ({name: (file, shape)}) do not fit `config` (a sentence), or None:
    more layers in config.json than in the files, a tensor missing, a tensor of another shape. Builds the model on
    the meta device: check its size first (`check_model_size`)."""
    problem = _layer_problem(config, tensors)
    if problem is not None:
        return problem
    renamed = _saved_names(config)
    expected, tied, prefix = _expected_shapes(config)
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


def read_config(folder: str):
    """config.json of `folder` through AutoConfig (after `import switchhead`, which registers ours), as
    UnloadableModel on failure."""
    from transformers import AutoConfig

    import switchhead  # noqa: F401 - registers the config class

    try:
        return AutoConfig.from_pretrained(folder)
    except (ValueError, TypeError, KeyError, OSError) as error:
        text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UnloadableModel(f"model folder {folder!r}: config.json does not load ({text})") from None


def check_saved_model(folder: str, verify: bool = True) -> None:
    """Refuse (UnloadableModel naming the problem) a saved model folder that should not be loaded; see the module
    docstring. Reads every tensor once; allocates no model."""
    if verify:
        check_model_folder(folder)
    files = weight_files(folder)
    config = read_config(folder)
    tensors = _headers(folder, files)
    problem = _layer_problem(config, tensors)  # before any model is built: config.json may ask for 10^6 layers
    if problem is None and isinstance(getattr(config, "num_hidden_layers", None), int):
        check_model_size(config, what=f"the model of {folder!r}")
        problem = weight_problem(config, tensors)
    if problem is not None:
        raise UnloadableModel(f"model folder {folder!r}: {problem}")
    _check_values(folder, config, tensors)


__all__ = ["UnloadableModel", "check_fits_memory", "check_model_size", "check_saved_model", "meta_model",
           "parameter_count", "physical_memory_bytes", "read_config", "weight_files", "weight_problem"]
