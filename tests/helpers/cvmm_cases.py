"""Random CVMM problems shaped like the model's four uses, shared by the kernel tests (not a test module)."""

from __future__ import annotations

import dataclasses
import functools

import torch

from switchhead import expert_ops

# (name, R, S, out_groups, gated) for H heads and k active experts, as the model calls the op
USES = {
    "value": lambda heads, k: (1, heads * k, heads, True),  # SwitchHead V: one input row, H groups out
    "output": lambda heads, k: (heads, heads * k, 1, True),  # SwitchHead O: H input rows, summed over heads
    "mlp_keys": lambda heads, k: (1, k, 1, False),  # sigma-MoE keys: no gates, [N, k, S] out
    "mlp_values": lambda heads, k: (k, k, 1, True),  # sigma-MoE values: k rows in, one row out
}


@dataclasses.dataclass
class Case:
    inputs: torch.Tensor
    expert_index: torch.Tensor
    weight: torch.Tensor
    gates: torch.Tensor | None
    out_groups: int

    def args(self):
        return self.inputs, self.expert_index, self.weight, self.gates, self.out_groups

    def leaves(self) -> list[torch.Tensor]:
        return [t for t in (self.inputs, self.weight, self.gates) if t is not None]

    def as_dtype(self, dtype: torch.dtype, gate_dtype: torch.dtype | None = None) -> "Case":
        """A detached copy in `dtype` (gates in `gate_dtype`, default float32 as the router gives them)."""
        def leaf(t, dt):
            return None if t is None else t.detach().to(dt).requires_grad_()
        return Case(leaf(self.inputs, dtype), self.expert_index, leaf(self.weight, dtype),
                    leaf(self.gates, gate_dtype or torch.float32), self.out_groups)


def random_index(generator: torch.Generator, tokens: int, heads: int, experts: int, k: int,
                 used_experts: int | None = None) -> torch.Tensor:
    """`[N, heads * k]` global expert ids: each head picks k distinct experts among its own `experts`.

    `used_experts` < experts restricts picks to the first few of each head, leaving the others empty.
    """
    pool = used_experts or experts
    picks = torch.rand(tokens, heads, pool, generator=generator).argsort(-1)[..., :k]
    return (picks + torch.arange(heads)[:, None] * experts).reshape(tokens, heads * k)


def random_case(generator: torch.Generator, use: str, tokens: int, heads: int, experts: int, k: int, d_in: int,
                d_out: int, dtype: torch.dtype = torch.float64, used_experts: int | None = None,
                strided: bool = False) -> Case:
    """A problem for one of `USES`; `strided=True` gives inputs / weight / gates non-contiguous strides."""
    rows, slots, out_groups, gated = USES[use](heads, k)
    groups = heads if use in ("value", "output") else 1
    index = random_index(generator, tokens, groups, experts, slots // groups, used_experts)

    def make(*shape, scale=1.0):
        if strided:  # allocate the transposed layout, then view it back: same values, odd strides
            t = torch.randn(*reversed(shape), generator=generator, dtype=torch.float64).permute(
                *reversed(range(len(shape))))
        else:
            t = torch.randn(*shape, generator=generator, dtype=torch.float64)
        return (t * scale).to(dtype)

    inputs = make(tokens, rows, d_in)
    weight = make(groups * experts, d_in, d_out, scale=d_in ** -0.5)
    gates = torch.sigmoid(make(tokens, slots)).to(torch.float32 if dtype != torch.float64 else dtype) \
        if gated else None
    case = Case(inputs.requires_grad_(), index, weight.requires_grad_(),
                None if gates is None else gates.requires_grad_(), out_groups)
    return case


def every_projection() -> dict:
    """Each entry of the op's one table by its name, and each formulation its "eager" rule chooses among (but the
    per-head one, which needs grouped routing), called directly: all take (inputs, index, weight, gates, groups)."""
    entries = {name: functools.partial(expert_ops.expert_projection, implementation=name)
               for name in expert_ops.EXPERTS_IMPLEMENTATIONS}
    formulations = (expert_ops._batched, expert_ops._all_experts, expert_ops._grouped, expert_ops._gathered)
    return {**entries, **{formulation.__name__: formulation for formulation in formulations}}
