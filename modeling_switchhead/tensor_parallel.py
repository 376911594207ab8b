"""Tensor parallelism for SwitchHead: the two styles its `base_model_tp_plan` names besides Transformers' own.

`config.base_model_tp_plan` shards the dense projections with Transformers' styles (colwise / rowwise) and the
per-head tensors that are not nn.Linear (SwitchHead's V/O experts `[H*E, ...]`, its routers W_S / W_D `[H*E, d]`,
the dense baseline's output gate `[H, d]`) with "switchhead_heads": each process owns whole heads. The sigma-MoE
experts take "switchhead_sigma_moe". The styles set on the modules what the model reads (local head and group
counts, the local routers' group offsets); the model itself holds no tensor-parallel code.

Part of the Hub-ready model: this file imports only torch and transformers; the model calls `register_styles`.
"""

import torch
from torch import nn

try:
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES, MoeExpertsParallel, TensorParallelLayer
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
        """All-reduce (sum) forward, identity backward: the per-head partial sums of a layer output (Megatron's `g`)."""

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

            def run(*args):
                *rest, hidden_states = args
                if torch.is_grad_enabled() and hidden_states.requires_grad:
                    hidden_states = _SumGradients.apply(hidden_states, group)
                with self.context_around_forward(module, mesh):
                    out = method(*rest, hidden_states)
                return _SumOutputs.apply(out, group) if sum_output else out

            return run

    class SigmaMoeParallel(MoeExpertsParallel):
        """Tensor-parallel style "switchhead_sigma_moe": Transformers' "moe_tp_experts" on `SigmaMoeMLP.run_experts`.

        The router (`expert_selection`) stays replicated and outside: every process picks the same global top-k
        and gets the router's full gradient (the entropy regulariser's included, counted once). The experts call
        runs on this process's slice of each expert's hidden size (`expert_keys` / `expert_values` sharded by the
        plan), its input and gates sum their gradients over processes, and its output (a partial sum over the slices)
        is all-reduced: `MoeExpertsParallel`'s transforms, around `run_experts` instead of the whole `forward`.
        """

        def install_forward(self, module, mesh):
            experts = module.run_experts

            def run(*args, **kwargs):
                args, kwargs = self.transform_inputs_pre_forward(module, args, kwargs, mesh)
                with self.context_around_forward(module, mesh):
                    out = experts(*args, **kwargs)
                return self.transform_output_post_forward(module, out, mesh)

            module.run_experts = run
            return module



def register_styles() -> None:
    """Register "switchhead_heads" and "switchhead_sigma_moe" with Transformers (where it has tensor parallelism)."""
    if TensorParallelLayer is not None:
        ALL_PARALLEL_STYLES.register("switchhead_heads", HeadParallel())
        ALL_PARALLEL_STYLES.register("switchhead_sigma_moe", SigmaMoeParallel())
