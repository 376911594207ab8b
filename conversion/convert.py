"""File-to-file conversions between the authors' checkpoints and `save_pretrained` folders: their SwitchHead training
code's checkpoints, models around their SwitchHead module, and their MoEUT module's `MoEUTLM` state dicts.

Each function validates everything (keys, shapes, architecture) before writing, and writes through
`atomic_output`: on any error the destination does not appear.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from safetensors.torch import load_file

from switchhead import SwitchHeadConfig

from .authors_format import (
    authors_checkpoint,
    config_and_state_from_authors_checkpoint,
    state_dict_from_module,
    state_dict_to_module,
)
from .checkpoint_io import ConversionError, atomic_output, load_hf_folder, load_torch_checkpoint, save_hf_folder
from .moeut_format import moeut_args_from_config, moeut_config_and_state, profile_arguments, state_dict_to_moeut


def _cast(tensors: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    if dtype is None:
        return tensors
    return {key: t.to(dtype) if t.is_floating_point() else t for key, t in tensors.items()}


def _save_torch(obj: Any, output: str) -> None:
    with atomic_output(output, is_dir=False) as staging:
        torch.save(obj, staging)


def convert_authors_checkpoint(input_path: str, output_dir: str, allow_pickle: bool = False,
                               dtype: torch.dtype | None = None, max_shard_size: str | int = "5GB") -> SwitchHeadConfig:
    """The authors' training checkpoint (`model-*.pth`) -> a `save_pretrained` folder; returns the config."""
    config, state_dict = config_and_state_from_authors_checkpoint(load_torch_checkpoint(input_path, allow_pickle))
    save_hf_folder(state_dict, config, output_dir, dtype=dtype, max_shard_size=max_shard_size)
    return config


def export_authors_checkpoint(model_dir: str, output_path: str, dtype: torch.dtype | None = None) -> None:
    """A `save_pretrained` folder -> a training checkpoint the authors' code restores (`-restore PATH`)."""
    config, state_dict = load_hf_folder(model_dir)
    _save_torch(authors_checkpoint(config, _cast(state_dict, dtype)), output_path)


def load_module_state_dict(input_path: str, allow_pickle: bool = False) -> dict[str, torch.Tensor]:
    """A state dict saved by the user (`.safetensors`, or `torch.save` of it, possibly under 'state_dict'/'model')."""
    if input_path.endswith(".safetensors"):
        if not os.path.isfile(input_path):
            raise FileNotFoundError(f"no such checkpoint file: {input_path}")
        return load_file(input_path)
    loaded = load_torch_checkpoint(input_path, allow_pickle)
    if isinstance(loaded, dict) and not all(isinstance(v, torch.Tensor) for v in loaded.values()):
        for name in ("state_dict", "model"):
            if isinstance(loaded.get(name), dict):
                loaded = loaded[name]
                break
    if not isinstance(loaded, dict) or not all(isinstance(v, torch.Tensor) for v in loaded.values()):
        raise ConversionError(f"{input_path} is not a state dict (a dict of tensors, optionally under 'state_dict')")
    return loaded


def convert_module_checkpoint(input_path: str, output_dir: str, config: SwitchHeadConfig, layer_prefix: str,
                              renames: dict[str, str] | None = None, allow_pickle: bool = False,
                              dtype: torch.dtype | None = None, max_shard_size: str | int = "5GB") -> None:
    """A model built around the user-facing SwitchHead module -> a `save_pretrained` folder for `config`."""
    state_dict = state_dict_from_module(load_module_state_dict(input_path, allow_pickle), config, layer_prefix,
                                        renames)
    save_hf_folder(state_dict, config, output_dir, dtype=dtype, max_shard_size=max_shard_size)


def export_module_checkpoint(model_dir: str, output_path: str, layer_prefix: str,
                             renames: dict[str, str] | None = None, dtype: torch.dtype | None = None) -> None:
    """A `save_pretrained` folder -> the user's state dict (`.safetensors` or `torch.save`, by the file name)."""
    config, state_dict = load_hf_folder(model_dir)
    _save_state_dict(_cast(state_dict_to_module(state_dict, config, layer_prefix, renames), dtype), output_path)


def _save_state_dict(tensors: dict[str, torch.Tensor], output_path: str) -> None:
    """A plain state dict: `.safetensors` by that suffix, else `torch.save` (what `torch.load` reads back)."""
    if output_path.endswith(".safetensors"):
        from safetensors.torch import save_file

        with atomic_output(output_path, is_dir=False) as staging:
            save_file({k: t.contiguous() for k, t in tensors.items()}, staging)
    else:
        _save_torch(tensors, output_path)


def _one_dtype(tensors: dict[str, torch.Tensor]) -> torch.dtype | None:
    """The floating-point dtype all tensors share, or None if they mix dtypes."""
    dtypes = {t.dtype for t in tensors.values() if t.is_floating_point()}
    return dtypes.pop() if len(dtypes) == 1 else None


def convert_moeut_checkpoint(input_path: str, output_dir: str, moeut_args: dict[str, Any] | None = None,
                             profile: str | None = None, allow_pickle: bool = False,
                             dtype: torch.dtype | None = None,
                             max_shard_size: str | int = "5GB") -> tuple[SwitchHeadConfig, dict[str, Any]]:
    """The authors' `MoEUTLM.state_dict()` saved to a file -> a `save_pretrained` folder; returns our config and
    their completed constructor arguments. The architecture is `moeut_args` (their keyword arguments, n_tokens
    included) or `profile` (a name from their profiles.py; n_tokens is read from the embedding). Without `dtype`
    the folder keeps the file's dtype when all its tensors share one (a bf16 file gives a bf16 folder)."""
    if (moeut_args is None) == (profile is None):
        raise ConversionError("give the MoEUT architecture once: its constructor arguments or a profile name")
    state = load_module_state_dict(input_path, allow_pickle)
    if profile is not None:
        embedding = state.get("embedding.weight")
        if not isinstance(embedding, torch.Tensor) or embedding.dim() != 2:
            raise ConversionError(f"{input_path} has no 2-D embedding.weight to read n_tokens from; give the "
                                  f"constructor arguments instead of a profile")
        moeut_args = profile_arguments(profile, int(embedding.shape[0]))
    config, state_dict, args = moeut_config_and_state(state, moeut_args)
    save_hf_folder(state_dict, config, output_dir, dtype=dtype or _one_dtype(state_dict),
                   max_shard_size=max_shard_size)
    return config, args


def export_moeut_checkpoint(model_dir: str, output_path: str, dtype: torch.dtype | None = None) -> dict[str, Any]:
    """A `save_pretrained` folder of a MoEUT configuration -> the state dict of the authors' `MoEUTLM` (their
    names; `.safetensors` or `torch.save` by the file name); returns the constructor arguments that build it."""
    config, state_dict = load_hf_folder(model_dir)
    args = moeut_args_from_config(config)
    _save_state_dict(_cast(state_dict_to_moeut(state_dict, config), dtype), output_path)
    return args


__all__ = ["convert_authors_checkpoint", "export_authors_checkpoint", "convert_module_checkpoint",
           "export_module_checkpoint", "convert_moeut_checkpoint", "export_moeut_checkpoint", "load_module_state_dict"]
