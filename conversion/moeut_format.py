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

Files (`switchhead convert moeut-to-hf` / `hf-to-moeut`): a file holds only tensors, so the architecture comes from
the constructor arguments, `MoEUTLM(n_tokens, d_model, ...)` by their names (`moeut_arguments` checks and completes
them with the constructor's defaults), or from a profile name of their `profiles.py` (`profile_arguments`, with
n_tokens read from the embedding). Every tensor is checked against the shape those arguments give before anything is
written. Refused, each with the reason: n_layers not a multiple of group_size (their module would apply only
(n_layers // group_size) * group_size layers), a head size whose rotated half `int(d_head / 2)` is odd or zero
(their RoPE table then fails to build, or there is no position encoding: their module has no forward to match),
expert dropout, a custom `attention` class, and the `MoEUT` body alone (no embedding, output norm or head).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from .. import SwitchHeadConfig
from .checkpoint_io import ConversionError

_BLOCK = {  # in the order of their module's state_dict (a module's own parameters before its children's)
    "attention.v": "self_attn.value_experts",
    "attention.o": "self_attn.output_experts",
    "attention.sel_v": "self_attn.value_selection.weight",
    "attention.sel_o": "self_attn.output_selection.weight",
    "attention.q.weight": "self_attn.q_proj.weight",
    "attention.k.weight": "self_attn.k_proj.weight",
    "ffn.keys": "mlp.experts.expert_keys",
    "ffn.values": "mlp.experts.expert_values",
    "ffn.expert_sel": "mlp.gate.weight",
    "ln1.weight": "input_layernorm.weight",
    "ln1.bias": "input_layernorm.bias",
    "ln2.weight": "post_attention_layernorm.weight",
    "ln2.bias": "post_attention_layernorm.bias",
}
# in the order of their module's state_dict: the shared blocks, then embedding, lm_head and out_norm
_ENDS = {"embedding.weight": "model.embed_tokens.weight", "lm_head.weight": "lm_head.weight",
         "lm_head.bias": "lm_head.bias", "out_norm.weight": "model.norm.weight", "out_norm.bias": "model.norm.bias"}


def config_from_moeut_args(n_tokens: int, d_model: int, n_layers: int, n_heads: int, ff_n_experts: int,
                           att_n_experts: int, d_head: int | None = None, group_size: int = 2, ff_k: int = 8,
                           att_k: int = 2, ff_expert_dropout: float = 0.0, att_expert_dropout: float = 0.0,
                           ff_expert_size: int = 128, dropout: float = 0.0, entropy_reg: float = 0.01,
                           att_entropy_reg: float = 0.001, **overrides) -> SwitchHeadConfig:
    """Our configuration of a `MoEUTLM(n_tokens, ...)` built with these arguments (their names and defaults)."""
    _check_convertible(att_n_experts, ff_expert_dropout, att_expert_dropout)
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


def _check_convertible(att_n_experts: int, ff_expert_dropout: float, att_expert_dropout: float) -> None:
    if att_n_experts < 2:
        raise ConversionError(f"att_n_experts={att_n_experts}: the authors' one-expert attention (a dense layer with "
                              f"an output gate) is not converted; only SwitchHead attention (att_n_experts >= 2) is")
    if ff_expert_dropout or att_expert_dropout:
        raise ConversionError("ff_expert_dropout / att_expert_dropout: the authors' expert dropout masks scores with "
                              "-inf before the top-k, unlike this package's sigma-MoE; convert models built without it")


# the constructor arguments of `MoEUTLM` that fix its tensors or forward (their `attention` class is not one of them:
# only the default SwitchHeadRope is converted); the first six have no default
_REQUIRED = ("n_tokens", "d_model", "n_layers", "n_heads", "ff_n_experts", "att_n_experts")
_DEFAULTS = {name: parameter.default for name, parameter in inspect.signature(config_from_moeut_args).parameters.items()
             if parameter.kind is parameter.POSITIONAL_OR_KEYWORD and name not in _REQUIRED}
_RATES = ("ff_expert_dropout", "att_expert_dropout", "dropout", "entropy_reg", "att_entropy_reg")

# profiles.py's dicts, by their names, are the presets built from them (vocabulary aside), with the fields where a
# preset follows the paper's run instead (MoEUT_727M has d_model 1024 there; the paper's 727M run, the preset, 1280)
PROFILE_PRESETS = {"MoEUT_44M": "moeut-44m", "MoEUT_126M": "moeut-126m", "MoEUT_244M": "moeut-244m",
                   "MoEUT_318M": "moeut-318m", "MoEUT_727M": "moeut-727m", "MoEUT_1B": "moeut-1b"}
PROFILE_FIELDS = {"MoEUT_727M": {"hidden_size": 1024}}


def profile_config(profile: str) -> SwitchHeadConfig:
    """Our configuration of `MoEUTLM(8000, **profiles.<profile>)`."""
    if profile not in PROFILE_PRESETS:
        raise ConversionError(f"unknown MoEUT profile {profile!r}; profiles.py has {', '.join(PROFILE_PRESETS)}")
    return SwitchHeadConfig.from_preset(PROFILE_PRESETS[profile], **PROFILE_FIELDS.get(profile, {}))


def moeut_arguments(given: dict[str, Any]) -> dict[str, Any]:
    """The authors' constructor arguments, checked and completed with the constructor's defaults; ConversionError
    naming the argument for anything their `MoEUTLM` would not build or this package cannot match exactly."""
    if not isinstance(given, dict):
        raise ConversionError(f"the MoEUT arguments must be a JSON object of MoEUTLM's keyword arguments, "
                              f"got {type(given).__name__}")
    if "attention" in given:
        raise ConversionError("attention: only the authors' default attention class (SwitchHeadRope) is converted; "
                              "leave the argument out")
    unknown = sorted(set(given) - set(_REQUIRED) - set(_DEFAULTS))
    if unknown:
        raise ConversionError(f"unknown MoEUTLM argument(s) {', '.join(unknown)}; its arguments are "
                              f"{', '.join((*_REQUIRED, *_DEFAULTS))}")
    missing = [name for name in _REQUIRED if name not in given]
    if missing:
        raise ConversionError(f"the MoEUT arguments lack {', '.join(missing)} (MoEUTLM has no default for them)")
    args = {name: given[name] if name in given else _DEFAULTS.get(name) for name in (*_REQUIRED, *_DEFAULTS)}
    for name, value in args.items():
        if name in _RATES:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
                raise ConversionError(f"{name} must be a finite number >= 0, got {value!r}")
        elif not (value is None and name == "d_head") and (isinstance(value, bool) or not isinstance(value, int)
                                                           or value < 1):
            raise ConversionError(f"{name} must be a positive integer, got {value!r}")
    _check_convertible(args["att_n_experts"], args["ff_expert_dropout"], args["att_expert_dropout"])
    if args["n_layers"] % args["group_size"]:
        applied = args["n_layers"] // args["group_size"] * args["group_size"]
        raise ConversionError(f"n_layers ({args['n_layers']}) is not a multiple of group_size ({args['group_size']}): "
                              f"the authors' module would apply only {applied} layers; give n_layers={applied} to "
                              f"convert what it runs")
    head = args["d_head"] or args["d_model"] // args["n_heads"]
    if head < 1:
        raise ConversionError(f"d_model ({args['d_model']}) // n_heads ({args['n_heads']}) gives no head channels; "
                              f"give d_head")
    rotated = int(0.5 * head)
    if rotated < 2 or rotated % 2:
        raise ConversionError(f"a head of {head} channels gives the authors' RoPE int({head} / 2) = {rotated} rotated "
                              f"channels: " + ("an odd count, for which their module's forward fails (its cos/sin "
                                               "table has one column more)" if rotated % 2 else
                                               "no position encoding, which this package's RoPE cannot match")
                              + "; there are no logits to match")
    return args


def profile_arguments(profile: str, n_tokens: int) -> dict[str, Any]:
    """The arguments of `MoEUTLM(n_tokens, **profiles.<profile>)`, from the preset built from that profile."""
    args = moeut_args_from_config(profile_config(profile))
    return moeut_arguments({**args, "n_tokens": n_tokens})


def moeut_shapes(args: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor of `MoEUTLM(**args).state_dict()` by the authors' name, with the shape their module gives it."""
    d, heads, vocab = args["d_model"], args["n_heads"], args["n_tokens"]
    head = args["d_head"] or d // heads
    slots, experts, size = heads * args["att_n_experts"], args["ff_n_experts"], args["ff_expert_size"]
    shapes = {}
    block = {"attention.v": (slots, d, head), "attention.o": (slots, head, d), "attention.sel_v": (slots, d),
             "attention.sel_o": (slots, d), "attention.q.weight": (heads * head, d),
             "attention.k.weight": (heads * head, d), "ffn.keys": (experts, d, size), "ffn.values": (experts, size, d),
             "ffn.expert_sel": (experts, d), "ln1.weight": (d,), "ln1.bias": (d,), "ln2.weight": (d,),
             "ln2.bias": (d,)}
    for member in range(args["group_size"]):
        shapes.update({f"transformer.layers.{member}.{name}": shape for name, shape in block.items()})
    return {**shapes, "embedding.weight": (vocab, d), "lm_head.weight": (vocab, d), "lm_head.bias": (vocab,),
            "out_norm.weight": (d,), "out_norm.bias": (d,)}


def _listing(names: list[str], limit: int = 5) -> str:
    return ", ".join(names[:limit]) + (f" (and {len(names) - limit} more)" if len(names) > limit else "")


def check_moeut_state(state: dict[str, torch.Tensor], args: dict[str, Any]) -> None:
    """ConversionError naming the first problem of an authors' state dict against the arguments: a `MoEUT` body
    without the language-model parts, unknown or missing names, a shape the arguments do not give, a non-float."""
    expected = moeut_shapes(args)
    if "embedding.weight" not in state and any(name.startswith("layers.") for name in state):
        raise ConversionError("this is the state dict of the authors' MoEUT body (layers.*): it has no embedding, "
                              "output norm or head, which a language model folder needs; convert the MoEUTLM "
                              "around it (transformer.layers.*, embedding, out_norm, lm_head)")
    unknown = sorted(set(state) - set(expected))
    if unknown:
        raise ConversionError(f"the MoEUT state dict has names that MoEUTLM with these arguments does not: "
                              f"{_listing(unknown)}")
    missing = [name for name in expected if name not in state]
    if missing:
        raise ConversionError(f"the MoEUT state dict lacks {_listing(missing)}")
    for name, shape in expected.items():
        tensor = state[name]
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
            raise ConversionError(f"the MoEUT state dict's {name} is not a floating-point tensor")
        if tuple(tensor.shape) != shape:
            raise ConversionError(f"the MoEUT state dict's {name} has shape {list(tensor.shape)}, but the arguments "
                                  f"give {list(shape)}")


def moeut_args_from_config(config: SwitchHeadConfig) -> dict[str, Any]:
    """The authors' `MoEUTLM` arguments for our MoEUT configuration (the inverse of `config_from_moeut_args`);
    ConversionError naming the fields if their module cannot express the configuration."""
    _check_moeut(config)
    args = dict(n_tokens=config.vocab_size, d_model=config.hidden_size, n_layers=config.num_hidden_layers,
                n_heads=config.num_attention_heads, ff_n_experts=config.num_mlp_experts,
                att_n_experts=config.num_attention_experts, d_head=config.head_dim,
                group_size=config.layer_group_size, ff_k=config.num_mlp_experts_per_tok,
                att_k=config.num_attention_experts_per_tok, ff_expert_dropout=0.0, att_expert_dropout=0.0,
                ff_expert_size=config.mlp_expert_size, dropout=config.hidden_dropout,
                entropy_reg=config.entropy_reg_coef, att_entropy_reg=config.attention_entropy_reg_coef)
    # every field that shapes the tensors or the forward must be what their module has; fields that only act in
    # training (dropouts, regularisation, initialisation) or bound the length (RoPE has no table) may differ
    rebuilt = config_from_moeut_args(**args, max_position_embeddings=config.max_position_embeddings).to_dict()
    ours = config.to_dict()
    differing = [name for name in SwitchHeadConfig.__annotations__  # the model's own fields, not Transformers'
                 if name not in _NOT_ARCHITECTURE and rebuilt.get(name) != ours.get(name)]
    if differing:
        raise ConversionError("the authors' MoEUT module cannot express this configuration's "
                              + ", ".join(f"{name}={ours.get(name)!r} (theirs: {rebuilt.get(name)!r})"
                                          for name in differing))
    return moeut_arguments(args)  # and what their module could not run (n_layers, the rotated half) is refused


_NOT_ARCHITECTURE = {
    "use_cache", "output_router_logits", "pad_token_id", "bos_token_id", "eos_token_id", "max_position_embeddings", "intermediate_size",  # a length bound; the dense MLP's width (no dense MLP here)
    "attention_dropout", "hidden_dropout", "attention_expert_dropout", "mlp_expert_dropout", "entropy_reg_coef",
    "attention_entropy_reg_coef", "entropy_reg_scope", "init_scale", "initializer_range",
}


def moeut_config_and_state(state: dict[str, torch.Tensor], given: dict[str, Any]) \
        -> tuple[SwitchHeadConfig, dict[str, torch.Tensor], dict[str, Any]]:
    """The authors' `MoEUTLM.state_dict()` and constructor arguments -> our config, our state dict (same tensors)
    and the completed arguments; everything is checked first (ConversionError)."""
    args = moeut_arguments(given)
    check_moeut_state(state, args)
    try:
        config = config_from_moeut_args(**args)
    except ConversionError:
        raise
    except ValueError as error:  # e.g. ff_k > ff_n_experts: their top-k would fail too
        raise ConversionError(f"the MoEUT arguments give no valid model: {error}") from None
    return config, state_dict_from_moeut(state, config), args


def _check_moeut(config: SwitchHeadConfig) -> None:
    if config.layer_group_size is None or config.layernorm_placement != "peri" or config.mlp_type != "sigma_moe" \
            or config.attention_type != "switchhead" or config.attention_expert_projections != "value_output":
        raise ConversionError("not a MoEUT configuration: the authors' module has layer_group_size set, "
                         "layernorm_placement='peri', SwitchHead attention (value and output experts) and a "
                         "sigma-MoE MLP")


def _renames(config: SwitchHeadConfig) -> dict[str, str]:
    """Their name -> ours, for every tensor of the model."""
    names = {}
    for member in range(config.layer_group_size):
        names.update({f"transformer.layers.{member}.{theirs}": f"model.layers.{member}.{ours}"
                      for theirs, ours in _BLOCK.items()})
    return {**names, **_ENDS}


def _moved(state: dict[str, torch.Tensor], names: dict[str, str], direction: str) -> dict[str, torch.Tensor]:
    missing, extra = sorted(set(names) - set(state)), sorted(set(state) - set(names))
    if missing or extra:
        raise ConversionError(f"{direction}: the state dict does not match the configuration: missing "
                         f"{missing[:5]}{'...' if len(missing) > 5 else ''}, unexpected "
                         f"{extra[:5]}{'...' if len(extra) > 5 else ''}")
    return {names[name]: state[name] for name in names}  # in the order of `names`


def state_dict_from_moeut(state: dict[str, torch.Tensor], config: SwitchHeadConfig) -> dict[str, torch.Tensor]:
    """The authors' `MoEUTLM.state_dict()` -> ours (same tensors, renamed); every name must be there."""
    _check_moeut(config)
    return _moved(state, _renames(config), "from MoEUT")


def state_dict_to_moeut(state: dict[str, torch.Tensor], config: SwitchHeadConfig) -> dict[str, torch.Tensor]:
    """Ours -> the authors' `MoEUTLM` names (the inverse of `state_dict_from_moeut`, bit-exact)."""
    _check_moeut(config)
    return _moved(state, {ours: theirs for theirs, ours in _renames(config).items()}, "to MoEUT")


__all__ = ["PROFILE_FIELDS", "PROFILE_PRESETS", "check_moeut_state", "config_from_moeut_args", "moeut_args_from_config",
           "moeut_arguments", "moeut_config_and_state", "moeut_shapes", "profile_arguments", "state_dict_from_moeut",
           "state_dict_to_moeut"]
