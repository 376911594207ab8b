"""Tensor parallelism for SwitchHead: the style its `base_model_tp_plan` names besides Transformers' own.

`config.base_model_tp_plan` shards the dense projections with Transformers' styles (colwise / rowwise) and the
per-head tensors that are not nn.Linear (SwitchHead's V/O experts `[H*E, ...]`, its routers W_S / W_D `[H*E, d]`,
the dense baseline's output gate `[H, d]`) with "switchhead_heads": each process owns whole heads. The sigma-MoE
experts (`mlp.experts`) take Transformers' "moe_tp_experts", and under expert parallelism its "ep_dispatch_experts"
(`base_model_ep_plan`). The styles set on the modules what the model reads (local head and group
counts, the local routers' group offsets); the model itself holds no tensor-parallel code.

Part of the Hub-ready model: this file imports only torch and transformers; the model calls `register_styles`.
"""

import torch
from torch import nn

try:
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES, TensorParallelLayer
except ImportError:  # no torch.distributed (or an older Transformers): no tensor parallelism, nothing else changes
    TensorParallelLayer = None

if TensorParallelLayer is not None:

    class _SumGradients(torch.autograd.Function):
        """Identity forward, all-reduce (sum) backward: the input of a per-head computation (Megatron's `f`)."""

        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            grad = grad.contiguous()
            dist.all_reduce(grad, group=ctx.group)
            return grad, None

    class _SumOutputs(torch.autograd.Function):
        """All-reduce (sum) forward, identity backward: the per-head partial sums of a layer output (Megatron's
        `g`)."""

        @staticmethod
        def forward(ctx, x, group):
            x = x.clone()
            dist.all_reduce(x, group=group)
            return x

        @staticmethod
        def backward(ctx, grad):
            return grad, None

    class HeadParallel(TensorParallelLayer):
        """Tensor-parallel style "switchhead_heads": per-head tensors split by heads, computed on local shards.

        Parameters (every direct parameter of the module it is planned on) are split along dim 0, whose rows are
        grouped by head (`[H*E, ...]` experts and routers, `[H, d]` gate): a process owns whole heads, so its
        expert ids (head * E + e within its heads) index its local rows. On an `ExpertSelection` (a router) the
        forward runs on the local rows: logits, top-k and gates of this process's heads only. On an attention
        layer its `project_values` / `project_output` run on local tensors, `num_heads` becomes the local count,
        and the input the per-head tensors read (`hidden_states`) sums its gradient over processes (`f`); with
        output experts the result is this process's heads' part of the sum over heads, summed over processes
        (`g`), while a layer with an `o_proj` (planned rowwise) leaves that sum to it. Q/K/V/W_pk are colwise and
        o_proj rowwise (Transformers' styles), so attention itself runs on local heads with no collective.
        """

        def should_use_local_tensors(self, module):
            return True

        def shard_param(self, module, param, mesh):
            meta = module._parameters.get(param)
            if meta is None:
                return
            if meta.shape[0] % mesh.size():
                raise ValueError(f"{param} has {meta.shape[0]} rows: not divisible by the tensor-parallel size "
                                 f"{mesh.size()} (the number of heads must be)")
            module._parameters[param] = nn.Parameter(distribute_tensor(meta, mesh, [Shard(0)], src_data_rank=None),
                                                     requires_grad=meta.requires_grad)

        def install_forward(self, module, mesh):
            if not hasattr(module, "project_output"):  # a router: local rows, local forward, its heads' offsets
                module.num_groups //= mesh.size()
                module.group_offsets = module.group_offsets[:module.num_groups]
                return super().install_forward(module, mesh)
            if module.num_heads % mesh.size():
                raise ValueError(f"{module.num_heads} attention heads do not split over {mesh.size()} processes")
            module.num_heads //= mesh.size()
            own = module._parameters
            if own.get("value_experts") is not None:
                module.project_values = self._local(module, module.project_values, mesh, sum_output=False)
            if own.get("output_experts") is not None or own.get("output_gate") is not None:
                module.project_output = self._local(module, module.project_output, mesh,
                                                    sum_output=not isinstance(getattr(module, "o_proj", None),
                                                                              nn.Linear))
            return module

        def _local(self, module, method, mesh, sum_output):
            group = mesh.get_group()

            def run(*args, **kwargs):
                *rest, hidden_states = args
                if torch.is_grad_enabled() and hidden_states.requires_grad:
                    hidden_states = _SumGradients.apply(hidden_states, group)
                routed = kwargs.get("router_states")  # a second replicated input (MoEUT's value router reads it)
                if routed is not None and torch.is_grad_enabled() and routed.requires_grad:
                    kwargs["router_states"] = _SumGradients.apply(routed, group)
                with self.context_around_forward(module, mesh):
                    out = method(*rest, hidden_states, **kwargs)
                return _SumOutputs.apply(out, group) if sum_output else out

            return run


def register_styles() -> None:
    """Register "switchhead_heads" with Transformers (where it has tensor parallelism)."""
    if TensorParallelLayer is not None:
        ALL_PARALLEL_STYLES.register("switchhead_heads", HeadParallel())


def check_parallel_plans(config, distributed_config, ep_plan: dict[str, str]) -> None:
    """Refuse, at load, what Transformers' distributed engine would run wrong or not at all for this model.

    - Expert parallelism shards the sigma-MoE MLP's experts (`base_model_ep_plan`). SwitchHead's attention experts
      are chosen per head (head h among its own E experts, V and O summed over heads): they split by head under
      `tp_size` ("switchhead_heads"), never by expert, so an `ep_plan` rule naming attention is an error, and so
      is `ep_size > 1` for a model without a sigma-MoE MLP.
    - `ep_plan` is the expanded plan (one entry per module or parameter) or the user's override.
    """
    ep_size = getattr(distributed_config, "ep_size", 1) or 1
    if ep_size > 1 and config.mlp_type != "sigma_moe":
        raise ValueError(
            f"ep_size={ep_size}: expert parallelism shards the sigma-MoE feed-forward experts (mlp_type='sigma_moe'); "
            f"this model's feed-forward is {config.mlp_type!r} and its attention experts split by head under "
            "tp_size: set ep_size=1 (and tp_size or fsdp_size instead)")
    attention = sorted(name for name in ep_plan or {} if "self_attn" in name.split("."))
    if attention:
        raise ValueError(
            f"ep_plan rules {attention} name attention: SwitchHead's attention experts are routed per head and split "
            "by head under tp_size (base_model_tp_plan), not by expert; expert parallelism covers the sigma-MoE MLP "
            "(layers.*.mlp.experts) only: remove those rules")


def refuse_pipeline_training(module, args, kwargs) -> None:
    """Forward pre-hook of a pipeline-parallel model: Transformers' pipeline stages pass activations forward only
    (no gradient flows back between stages, and the loss is not returned), so a training step would update part of
    the model, or none: refused while gradients are recorded in training mode."""
    if module.training and torch.is_grad_enabled():
        raise RuntimeError(
            "pipeline parallelism (pp_size > 1) runs inference only in Transformers' distributed engine: its stages "
            "send activations forward and no gradient back; train with tp_size / fsdp_size / ep_size, or call "
            "model.eval() / torch.no_grad() for inference")


def splits_attention_regulariser(config) -> bool:
    """Whether tensor parallelism would split a regulariser over the attention routers: MoEUT's group-wide entropy
    regulariser (`attention_entropy_reg_coef > 0`) averages over every head, and "switchhead_heads" gives each
    process the routers of its own heads only, so each would regularise its heads as if they were all of them."""
    return (getattr(config, "entropy_reg_scope", "layer") == "group" and config.attention_type == "switchhead"
            and getattr(config, "attention_entropy_reg_coef", 0.0) > 0)


SPLIT_ATTENTION_REGULARISER = (
    "tensor parallelism splits the attention routers by head, and MoEUT's attention entropy regulariser "
    "(attention_entropy_reg_coef > 0) averages over all heads: each process would regularise only its own heads "
    "(wrong gradients and aux_loss); train with fsdp_size instead, or set attention_entropy_reg_coef=0 "
    "(tensor-parallel inference is exact)")


def refuse_split_attention_regulariser(module, args, kwargs) -> None:
    """Forward pre-hook of a tensor-parallel model whose attention routers carry MoEUT's regulariser: training (and
    a call asking for the router logits, whose aux_loss is that regulariser) refused; inference runs."""
    if (module.training and torch.is_grad_enabled()) or kwargs.get("output_router_logits"):
        raise RuntimeError(SPLIT_ATTENTION_REGULARISER)


class ParallelPlansMixin:
    """`_resolve_parallel_plans` for `from_pretrained(..., distributed_config=...)`: Transformers' plans, after
    refusing what its engine cannot run exactly for this model (`check_parallel_plans`; pipeline stages: inference
    only, `refuse_pipeline_training`; MoEUT's attention regulariser split by heads: inference only,
    `refuse_split_attention_regulariser`)."""

    def _resolve_parallel_plans(self, distributed_config):
        check_parallel_plans(self.config, distributed_config, distributed_config.ep_plan)
        tp_plan, ep_plan, fsdp_plan = super()._resolve_parallel_plans(distributed_config)
        check_parallel_plans(self.config, distributed_config, ep_plan)
        if (distributed_config.pp_size or 1) > 1:
            self.register_forward_pre_hook(refuse_pipeline_training, with_kwargs=True)
        if tp_plan and splits_attention_regulariser(self.config):
            self.register_forward_pre_hook(refuse_split_attention_regulariser, with_kwargs=True)
        return tp_plan, ep_plan, fsdp_plan
