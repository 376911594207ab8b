"""What a saved folder holds besides the model's tensors as it names them: the `auto_map` of every Auto class, and
the checkpoint names of tensors renamed since.

- `SavedFolderMixin.save_pretrained` (a base of `SwitchHeadPreTrainedModel`) writes an `auto_map` for every Auto
  class of `AUTO_MAP` (Transformers records only the saved class), so that one folder serves AutoConfig, AutoModel,
  AutoModelForCausalLM and the task heads with `trust_remote_code=True`: a causal LM's folder loads as a classifier
  with a new head, and back.
- `register_renamed_keys` registers `RENAMED_KEYS` with Transformers' conversion mapping for the model type
  "switchhead" (the model file calls it on import, in this package and in a folder's copy of the code alike).
  `from_pretrained` then reads a tensor saved under its old name into today's parameter, and `save_pretrained` writes
  the old name, as Transformers does for its own models' checkpoint formats (`save_original_format=False` writes
  today's names; both load). Saved folders therefore keep the names every release wrote, and an older release's code
  loads them. That code, run next to this package, is not disturbed by the registration: where a renamed key is not
  a parameter of the model and the saved one is, Transformers keeps the saved key. (Transformers 5.17 to 5.24 no
  longer read a class's `_checkpoint_conversion_mapping`; this registry is what they read.)
- `rename_old_keys` does the renaming for `torch.nn.Module.load_state_dict` (training checkpoints, conversions).

Part of the Hub-ready model: this file imports only transformers (and the standard library); the model imports it.
"""

from collections import OrderedDict

# Renamed tensors of the sigma-MoE MLP (SwitchAll), relative to the MLP: name in a checkpoint (the one every release
# wrote, and `save_pretrained` writes) -> parameter name. `keys` / `values` could not be parameter names: torch
# parametrizations (PEFT's LoRA on `target_parameters`) keep a `ModuleDict`, whose `keys()` / `values()` methods
# collide with them; the router and the experts are the children `gate` / `experts`, as in Transformers' MoE blocks.
RENAMED_MLP_PARAMETERS = {
    "keys": "experts.expert_keys",
    "values": "experts.expert_values",
    "expert_selection.weight": "gate.weight",
}
# the same as Transformers' renaming patterns on full checkpoint keys (`model.layers.{i}.mlp.keys`)
RENAMED_KEYS = {f"mlp.{old}": f"mlp.{new}" for old, new in RENAMED_MLP_PARAMETERS.items()}

AUTO_MAP = {
    "AutoConfig": "configuration_switchhead.SwitchHeadConfig",
    "AutoModel": "modeling_switchhead.SwitchHeadModel",
    "AutoModelForCausalLM": "modeling_switchhead.SwitchHeadForCausalLM",
    "AutoModelForSequenceClassification": "modeling_switchhead.SwitchHeadForSequenceClassification",
    "AutoModelForTokenClassification": "modeling_switchhead.SwitchHeadForTokenClassification",
    "AutoModelForQuestionAnswering": "modeling_switchhead.SwitchHeadForQuestionAnswering",
}


def register_renamed_keys(model_type: str = "switchhead") -> None:
    """Register `RENAMED_KEYS` as `model_type`'s checkpoint conversion mapping (replacing an earlier registration)."""
    from transformers.conversion_mapping import register_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightRenaming

    # dots escaped: a pattern is a regular expression
    renamings = [WeightRenaming(source_patterns=old.replace(".", r"\."), target_patterns=new)
                 for old, new in RENAMED_KEYS.items()]
    register_checkpoint_conversion_mapping(model_type, renamings, overwrite=True)


def rename_old_keys(state_dict: dict, prefix: str = "") -> None:
    """Rename, in place, the sigma-MoE tensors saved under their old names among the keys that start with `prefix`:
    an MLP's own (`{prefix}keys`, from its `_load_from_state_dict`) or a whole model's (`...mlp.keys`). A tensor
    present under both names is kept once when the two are equal; when they differ, which one is meant cannot be
    told: ValueError naming both."""
    for key in [key for key in state_dict if key.startswith(prefix)]:
        name = key[len(prefix):]
        for old, new in RENAMED_MLP_PARAMETERS.items():
            renamed = key[: len(key) - len(old)] + new
            if not (name == old or name.endswith(f"mlp.{old}")):
                continue
            if renamed in state_dict:
                saved, current = state_dict[key], state_dict[renamed]
                if getattr(saved, "shape", None) != getattr(current, "shape", None) or not saved.equal(current):
                    raise ValueError(f"the weights hold {key} (the name earlier releases wrote) and {renamed} "
                                     "(today's name) with different values; which one is meant cannot be told: "
                                     "remove one")
                del state_dict[key]
            else:
                state_dict[renamed] = state_dict.pop(key)
            break


class SavedFolderMixin:
    """`save_pretrained` with every Auto class of `AUTO_MAP` in the config's `auto_map`; `load_state_dict` taking the
    tensor names of earlier releases too (`rename_old_keys`)."""

    def save_pretrained(self, save_directory, *args, **kwargs):
        self.config.auto_map = {**(getattr(self.config, "auto_map", None) or {}), **AUTO_MAP}
        return super().save_pretrained(save_directory, *args, **kwargs)

    def load_state_dict(self, state_dict, *args, **kwargs):
        metadata = getattr(state_dict, "_metadata", None)
        state_dict = OrderedDict(state_dict)  # a copy (with torch's `_metadata`), renamed in place
        if metadata is not None:
            state_dict._metadata = metadata
        rename_old_keys(state_dict)
        return super().load_state_dict(state_dict, *args, **kwargs)
