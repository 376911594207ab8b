"""The authors' tensor names on our layers: a drop-in class holds one of our layers as a child and renames its
tensors in `state_dict()` and `load_state_dict()`, so a state dict of the authors' module loads strictly."""

from __future__ import annotations

from torch import nn


def use_authors_names(module: nn.Module, names: dict[str, str]) -> None:
    """Give `module`'s state dict the names `names` (ours relative to `module` -> the authors'), in that order."""
    authors_to_ours = {theirs: ours for ours, theirs in names.items()}

    def to_authors(_module, state_dict, prefix, _metadata):
        ours = {key: state_dict.pop(prefix + key) for key in names if prefix + key in state_dict}
        for key, value in ours.items():
            state_dict[prefix + names[key]] = value
        return state_dict

    def from_authors(state_dict, prefix, *_args):
        for theirs, ours in authors_to_ours.items():
            if prefix + theirs in state_dict:
                state_dict[prefix + ours] = state_dict.pop(prefix + theirs)

    module._register_state_dict_hook(to_authors)
    module._register_load_state_dict_pre_hook(from_authors)
