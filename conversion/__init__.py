"""switchhead.conversion: the authors' checkpoints in, `save_pretrained` safetensors folders out, and back.

- `convert_authors_checkpoint` / `export_authors_checkpoint`: the paper's training code (RobertCsordas/moe_attention).
- `convert_module_checkpoint` / `export_module_checkpoint`: models built around the user-facing SwitchHead module
  (RobertCsordas/switchhead) or our drop-in layers (`switchhead.layers`; `config_fields_from_layers` reads their
  config), given the layer prefix of its attention layers and prefix renames for the rest.
- `convert_moeut_checkpoint` / `export_moeut_checkpoint`: the authors' MoEUT module (RobertCsordas/moeut,
  `MoEUTLM`), its state dict plus its constructor arguments or a profile name; `moeut_format` holds the mapping.
- `authors_format`: the key/shape mapping (documented there as a table) on in-memory state dicts.

Loading is safe by default (`torch.load(weights_only=True)`); see `checkpoint_io`. CLI: `switchhead convert`.
"""

from .authors_format import (
    authors_checkpoint,
    config_and_state_from_authors_checkpoint,
    config_fields_from_layers,
    config_from_authors_args,
    state_dict_from_authors,
    state_dict_from_module,
    state_dict_to_authors,
    state_dict_to_module,
)
from .checkpoint_io import ConversionError, load_hf_folder, load_torch_checkpoint, save_hf_folder
from .convert import (
    convert_authors_checkpoint,
    convert_module_checkpoint,
    convert_moeut_checkpoint,
    export_authors_checkpoint,
    export_module_checkpoint,
    export_moeut_checkpoint,
)

__all__ = [
    "ConversionError",
    "authors_checkpoint",
    "config_and_state_from_authors_checkpoint",
    "config_fields_from_layers",
    "config_from_authors_args",
    "convert_authors_checkpoint",
    "convert_module_checkpoint",
    "convert_moeut_checkpoint",
    "export_authors_checkpoint",
    "export_module_checkpoint",
    "export_moeut_checkpoint",
    "load_hf_folder",
    "load_torch_checkpoint",
    "save_hf_folder",
    "state_dict_from_authors",
    "state_dict_from_module",
    "state_dict_to_authors",
    "state_dict_to_module",
]
