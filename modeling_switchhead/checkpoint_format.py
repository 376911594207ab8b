"""What a saved folder holds besides today's tensors: the `auto_map` of every Auto class, and the tensor names
older releases saved under.

`SavedFolderMixin` is a base of `SwitchHeadPreTrainedModel`:

- `save_pretrained` writes an `auto_map` for every Auto class of `AUTO_MAP` (Transformers records only the saved
  class), so that one folder serves AutoConfig, AutoModel, AutoModelForCausalLM and the task heads with
  `trust_remote_code=True`: a causal LM's folder loads as a classifier with a new head, and back.
- `from_pretrained` reads tensors saved under an older name (`RENAMED_KEYS`) as today's, through Transformers'
  `key_mapping` (what a caller passes as `key_mapping` is applied too). Transformers keeps the renaming it used for
  the next `save_pretrained` of that model (`save_original_format`), so a folder loaded under old names is saved
  under them again; a model built or loaded under today's names saves today's names.

The renaming is passed by the class itself rather than registered with `register_checkpoint_conversion_mapping`:
that registry is keyed by model type and class name, which an older folder's own copy of the code shares, so a
registered renaming would also rename the tensors that old code expects (a folder's code and this package can run
in one process). Transformers 5.17 to 5.24 no longer read a class's `_checkpoint_conversion_mapping`.

`rename_old_keys` does the same for `torch.nn.Module.load_state_dict` (training checkpoints, conversions).

Part of the Hub-ready model: this file imports nothing outside the standard library; the model imports it.
"""

AUTO_MAP = {
    "AutoConfig": "configuration_switchhead.SwitchHeadConfig",
    "AutoModel": "modeling_switchhead.SwitchHeadModel",
    "AutoModelForCausalLM": "modeling_switchhead.SwitchHeadForCausalLM",
    "AutoModelForSequenceClassification": "modeling_switchhead.SwitchHeadForSequenceClassification",
    "AutoModelForTokenClassification": "modeling_switchhead.SwitchHeadForTokenClassification",
    "AutoModelForQuestionAnswering": "modeling_switchhead.SwitchHeadForQuestionAnswering",
}

# Renamed parameters of the sigma-MoE MLP (SwitchAll): old name -> today's. `keys` / `values` could not take
# torch parametrizations (PEFT's LoRA on `target_parameters`): those keep a `ModuleDict`, whose `keys()` / `values()`
# methods collide with the names.
RENAMED_MLP_PARAMETERS = {"keys": "expert_keys", "values": "expert_values"}
# the same as Transformers key-mapping patterns on full checkpoint keys (`layers.{i}.mlp.keys`)
RENAMED_KEYS = {f"mlp.{old}": f"mlp.{new}" for old, new in RENAMED_MLP_PARAMETERS.items()}


def rename_old_keys(state_dict: dict, prefix: str = "") -> None:
    """Rename, in place, the sigma-MoE tensors saved under their old names among the keys that start with `prefix`:
    a module's own (`{prefix}keys`, from its `_load_from_state_dict`) or a whole model's (`...mlp.keys`)."""
    for key in [key for key in state_dict if key.startswith(prefix)]:
        name = key[len(prefix):]
        for old, new in RENAMED_MLP_PARAMETERS.items():
            renamed = key[: len(key) - len(old)] + new
            if (name == old or name.endswith(f"mlp.{old}")) and renamed not in state_dict:
                state_dict[renamed] = state_dict.pop(key)


class SavedFolderMixin:
    """`save_pretrained` with every Auto class in `auto_map`; `from_pretrained` that reads older tensor names."""

    @classmethod
    def from_pretrained(cls, *args, key_mapping: dict[str, str] | None = None, **kwargs):
        return super().from_pretrained(*args, key_mapping={**RENAMED_KEYS, **(key_mapping or {})}, **kwargs)

    def save_pretrained(self, save_directory, *args, **kwargs):
        self.config.auto_map = {**(getattr(self.config, "auto_map", None) or {}), **AUTO_MAP}
        return super().save_pretrained(save_directory, *args, **kwargs)
