"""The authors' MoEUT module (RobertCsordas/moeut, `MoEUTLM`) <-> our MoEUT configuration, on in-memory state dicts.

Their tensors and ours, per distinct block m (`transformer.layers.{m}.` -> `model.layers.{m}.`); every tensor keeps
its shape and layout (expert tensors `[H*E, ...]` head-major in both):

    attention.q.weight / attention.k.weight   self_attn.q_proj.weight / self_attn.k_proj.weight   [H*dh, d]
    attention.v  [H*E, d, dh]                 self_attn.value_experts
    attention.o  [H*E, dh, d]                 self_attn.output_experts
    attention.sel_v / attention.sel_o [H*E, d] self_attn.value_selection.weight / self_attn.output_selection.weight
    ffn.keys [E, d, S] / ffn.values [E, S, d] mlp.experts.expert_keys / mlp.experts.expert_values
    ffn.expert_sel [E, d]                     mlp.gate.weight
    ln1 / ln2 (weight, bias)                  input_layernorm / post_attention_layernorm

and `embedding.weight` -> `model.embed_tokens.weight`, `out_norm` -> `model.norm`, `lm_head` -> `lm_head`. Their
`att_n_experts=1` variant (dense attention with an output gate, other tensor shapes) is refused.
"""

from __future__ import annotations

import torch

from .. import SwitchHeadConfig

_BLOCK = {
    "attention.q.weight": "self_attn.q_proj.weight",
    "attention.k.weight": "self_attn.k_proj.weight",
    "attention.v": "self_attn.value_experts",
    "attention.o": "self_attn.output_experts",
    "attention.sel_v": "self_attn.value_selection.weight",
    "attention.sel_o": "self_attn.output_selection.weight",
    "ffn.keys": "mlp.experts.expert_keys",
    "ffn.values": "mlp.experts.expert_values",
    "ffn.expert_sel": "mlp.gate.weight",
    "ln1.weight": "input_layernorm.weight",
    "ln1.bias": "input_layernorm.bias",
    "ln2.weight": "post_attention_layernorm.weight",
    "ln2.bias": "post_attention_layernorm.bias",
}
_ENDS = {"embedding.weight": "model.embed_tokens.weight", "out_norm.weight": "model.norm.weight",
         "out_norm.bias": "model.norm.bias", "lm_head.weight": "lm_head.weight", "lm_head.bias": "lm_head.bias"}


def config_from_moeut_args(n_tokens: int, d_model: int, n_layers: int, n_heads: int, ff_n_experts: int,
                           att_n_experts: int, d_head: int | None = None, group_size: int = 2, ff_k: int = 8,
                           att_k: int = 2, ff_expert_dropout: float = 0.0, att_expert_dropout: float = 0.0,
                           ff_expert_size: int = 128, dropout: float = 0.0, entropy_reg: float = 0.01,
                           att_entropy_reg: float = 0.001, **overrides) -> SwitchHeadConfig:
    """Our configuration of a `MoEUTLM(n_tokens, ...)` built with these arguments (their names and defaults)."""
    if att_n_experts < 2:
        raise ValueError(f"att_n_experts={att_n_experts}: the authors' one-expert attention (a dense layer with an "
                         f"output gate) is not converted; only SwitchHead attention (att_n_experts >= 2) is")
    if ff_expert_dropout or att_expert_dropout:
        raise ValueError("ff_expert_dropout / att_expert_dropout: the authors' expert dropout masks scores with -inf "
                         "before the top-k, unlike this package's sigma-MoE; convert models built without it")
    fields = dict(
        vocab_size=n_tokens, hidden_size=d_model, num_hidden_layers=n_layers, num_attention_heads=n_heads,
        head_dim=d_head or d_model // n_heads, attention_type="switchhead", position_encoding="rope",
        num_attention_experts=att_n_experts, num_attention_experts_per_tok=att_k, mlp_type="sigma_moe",
        num_mlp_experts=ff_n_experts, mlp_expert_size=ff_expert_size, num_mlp_experts_per_tok=ff_k,
        hidden_dropout=dropout, layer_group_size=group_size, layernorm_placement="peri", entropy_reg_scope="group",
        entropy_reg_coef=entropy_reg, attention_entropy_reg_coef=att_entropy_reg,
    )
    fields.update(overrides)
    return SwitchHeadConfig(**fields)


def _check_moeut(config: SwitchHeadConfig) -> None:
    if config.layer_group_size is None or config.layernorm_placement != "peri" or config.mlp_type != "sigma_moe" \
            or config.attention_type != "switchhead" or config.attention_expert_projections != "value_output":
        raise ValueError("not a MoEUT configuration: the authors' module has layer_group_size set, "
                         "layernorm_placement='peri', SwitchHead attention (value and output experts) and a "
                         "sigma-MoE MLP")


def _renames(config: SwitchHeadConfig) -> dict[str, str]:
    """Their name -> ours, for every tensor of the model."""
    names = dict(_ENDS)
    for member in range(config.layer_group_size):
        names.update({f"transformer.layers.{member}.{theirs}": f"model.layers.{member}.{ours}"
                      for theirs, ours in _BLOCK.items()})
    return names


def _moved(state: dict[str, torch.Tensor], names: dict[str, str], direction: str) -> dict[str, torch.Tensor]:
    missing, extra = sorted(set(names) - set(state)), sorted(set(state) - set(names))
    if missing or extra:
        raise ValueError(f"{direction}: the state dict does not match the configuration: missing "
                         f"{missing[:5]}{'...' if len(missing) > 5 else ''}, unexpected "
                         f"{extra[:5]}{'...' if len(extra) > 5 else ''}")
    return {names[name]: tensor for name, tensor in state.items()}


def state_dict_from_moeut(state: dict[str, torch.Tensor], config: SwitchHeadConfig) -> dict[str, torch.Tensor]:
    """The authors' `MoEUTLM.state_dict()` -> ours (same tensors, renamed); every name must be there."""
    _check_moeut(config)
    return _moved(state, _renames(config), "from MoEUT")


def state_dict_to_moeut(state: dict[str, torch.Tensor], config: SwitchHeadConfig) -> dict[str, torch.Tensor]:
    """Ours -> the authors' `MoEUTLM` names (the inverse of `state_dict_from_moeut`, bit-exact)."""
    _check_moeut(config)
    return _moved(state, {ours: theirs for theirs, ours in _renames(config).items()}, "to MoEUT")


__all__ = ["config_from_moeut_args", "state_dict_from_moeut", "state_dict_to_moeut"]
