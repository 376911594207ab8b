"""Tensor parallelism on CPU: `from_pretrained(..., tp_plan="auto")` under `torchrun --nproc_per_node 2` (gloo).

`SwitchHeadConfig.base_model_tp_plan` splits attention by heads (q/k/position_key_proj colwise; SwitchHead's
value / output experts and routers along their head-grouped first dim with the "switchhead_heads" style; the dense
v/o colwise/rowwise), the dense feed-forward colwise/rowwise and the sigma-MoE along each expert's hidden size with
its router replicated. For every variant (and the value-only / output-only SwitchHead ablations), each process's logits must equal the single-process logits within 1e-5,
the loss gradient of every parameter (gathered from its shards) must equal the single-process gradient, and the
planned weights must really be sharded (DTensors holding half of the rows or columns named below).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from switchhead import SwitchHeadConfig, SwitchHeadForCausalLM

from helpers.network import free_port

WORKER = r'''
import json, os, sys, torch
from torch.distributed.tensor import DTensor
import switchhead
from switchhead import SwitchHeadForCausalLM
folder = sys.argv[1]
model = SwitchHeadForCausalLM.from_pretrained(folder, tp_plan="auto").eval()
if os.environ.get("EXPERTS_IMPLEMENTATION"):
    model.set_experts_implementation(os.environ["EXPERTS_IMPLEMENTATION"])
ids = torch.load(os.path.join(folder, "ids.pt"))
with torch.no_grad():
    logits = model(input_ids=ids).logits
reference = torch.load(os.path.join(folder, "reference.pt"))
sharded = {name: list(p.to_local().shape) for name, p in model.named_parameters() if isinstance(p, DTensor)}
# training: one loss gradient, every parameter's full gradient (all ranks gather DTensors in the same order)
model.train()
model(input_ids=ids, labels=ids).loss.backward()
grads = {name: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
         for name, p in model.named_parameters()}
reference_grads = torch.load(os.path.join(folder, "reference_grads.pt"))
grad_diff = {name: (grads[name] - g).abs().max().item() if grads[name] is not None else None
             for name, g in reference_grads.items()}
with open(os.path.join(folder, f"rank{os.environ['RANK']}.json"), "w") as handle:
    json.dump({"max_diff": (logits - reference).abs().max().item(), "sharded": sharded, "grad_diff": grad_diff},
              handle)
'''

CASES = {
    "tiny-dense": {},
    "tiny-dense-gate": {"attention_output_gate": True},
    "tiny-dense-xl": {},
    "tiny-switchhead": {},
    "tiny-switchhead-xl": {},
    "tiny-switchall": {},
    "tiny-switchhead-value": {"attention_expert_projections": "value"},  # expert V, dense o_proj (rowwise)
    "tiny-switchhead-output": {"attention_expert_projections": "output"},  # dense v_proj (colwise), expert O
    "tiny-switchhead-fused": {},  # experts_implementation="switchhead_fused" on the processes: one projection a time
    # shared blocks (one module per group member: each shared tensor planned once), peri-LayerNorm; its attention
    # regulariser would be split by heads, which training refuses (tests/model/test_moeut.py)
    "tiny-moeut": {"attention_entropy_reg_coef": 0.0},
}


def expected_shards(config: SwitchHeadConfig) -> dict[str, list[int]]:
    """Local shapes (of 2 processes) of layer 0's planned weights."""
    d, inner, layer = config.hidden_size, config.num_attention_heads * config.head_dim, "model.layers.0"
    shards = {f"{layer}.self_attn.q_proj.weight": [inner // 2, d], f"{layer}.self_attn.k_proj.weight": [inner // 2, d]}
    if config.position_encoding == "xl":
        shards[f"{layer}.self_attn.position_key_proj.weight"] = [inner // 2, d]
    if config.attention_type == "dense":
        shards[f"{layer}.self_attn.v_proj.weight"] = [inner // 2, d]
        shards[f"{layer}.self_attn.o_proj.weight"] = [d, inner // 2]
        if config.attention_output_gate:
            shards[f"{layer}.self_attn.output_gate"] = [config.num_attention_heads // 2, d]
    else:
        rows = config.num_attention_heads * config.num_attention_experts // 2  # whole heads' experts
        if config.attention_expert_projections in ("value_output", "value"):
            shards[f"{layer}.self_attn.value_experts"] = [rows, d, config.head_dim]
            shards[f"{layer}.self_attn.value_selection.weight"] = [rows, d]
        else:
            shards[f"{layer}.self_attn.v_proj.weight"] = [inner // 2, d]
        if config.attention_expert_projections in ("value_output", "output"):
            shards[f"{layer}.self_attn.output_experts"] = [rows, config.head_dim, d]
            shards[f"{layer}.self_attn.output_selection.weight"] = [rows, d]
        else:
            shards[f"{layer}.self_attn.o_proj.weight"] = [d, inner // 2]
    if config.mlp_type == "dense":
        shards[f"{layer}.mlp.up_proj.weight"] = [config.intermediate_size // 2, d]
        shards[f"{layer}.mlp.down_proj.weight"] = [d, config.intermediate_size // 2]
    else:  # each expert's hidden size split
        shards[f"{layer}.mlp.experts.expert_keys"] = [config.num_mlp_experts, d, config.mlp_expert_size // 2]
        shards[f"{layer}.mlp.experts.expert_values"] = [config.num_mlp_experts, config.mlp_expert_size // 2, d]
    return shards


@pytest.mark.integration
@pytest.mark.parametrize("case", list(CASES))
def test_tp_plan_auto_on_two_cpu_processes(tmp_path, case):
    preset = case.removesuffix("-gate").removesuffix("-value").removesuffix("-output").removesuffix("-fused")
    config = SwitchHeadConfig.from_preset(preset, hidden_dropout=0.0, **CASES[case])
    torch.manual_seed(0)
    model = SwitchHeadForCausalLM(config).eval()
    model.save_pretrained(tmp_path)
    ids = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    torch.save(ids, tmp_path / "ids.pt")
    with torch.no_grad():
        torch.save(model(input_ids=ids).logits, tmp_path / "reference.pt")
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    torch.save({name: p.grad for name, p in model.named_parameters()}, tmp_path / "reference_grads.pt")
    (tmp_path / "worker.py").write_text(WORKER)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "EXPERTS_IMPLEMENTATION": "switchhead_fused" if case.endswith("-fused") else ""}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(free_port()), str(tmp_path / "worker.py"), str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["max_diff"] < 1e-5, (rank, result["max_diff"])
        for name, shape in expected_shards(config).items():
            assert result["sharded"].get(name) == shape, (name, result["sharded"].get(name), shape)
        if config.mlp_type == "sigma_moe":  # the router stays whole (a global top-k)
            assert "model.layers.0.mlp.gate.weight" not in result["sharded"]
        grad_diff = result["grad_diff"]
        assert set(grad_diff) == {name for name, _ in model.named_parameters()}
        wrong = {name: diff for name, diff in grad_diff.items() if diff is None or diff > 1e-5}
        assert not wrong, (rank, wrong)
