"""Tensor parallelism on CPU: `from_pretrained(..., tp_plan="auto")` under `torchrun --nproc_per_node 2` (gloo).

`SwitchHeadConfig.base_model_tp_plan` shards the dense projections (dense RoPE attention by heads, the dense
feed-forward colwise/rowwise); SwitchHead's expert tensors stay replicated (see the property's docstring). Each
process's logits must equal the single-process logits within 1e-5, and the planned weights must really be
sharded (DTensors holding half of the rows or columns).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch

from switchhead import SwitchHeadConfig, SwitchHeadForCausalLM

WORKER = r'''
import json, os, sys, torch
from torch.distributed.tensor import DTensor
import switchhead
from switchhead import SwitchHeadForCausalLM
folder = sys.argv[1]
model = SwitchHeadForCausalLM.from_pretrained(folder, tp_plan="auto").eval()
ids = torch.load(os.path.join(folder, "ids.pt"))
with torch.no_grad():
    logits = model(input_ids=ids).logits
reference = torch.load(os.path.join(folder, "reference.pt"))
sharded = {name: list(p.to_local().shape) for name, p in model.named_parameters() if isinstance(p, DTensor)}
with open(os.path.join(folder, f"rank{os.environ['RANK']}.json"), "w") as handle:
    json.dump({"max_diff": (logits - reference).abs().max().item(), "sharded": sharded}, handle)
'''


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-switchhead"])
def test_tp_plan_auto_on_two_cpu_processes(tmp_path, preset):
    config = SwitchHeadConfig.from_preset(preset)
    torch.manual_seed(0)
    model = SwitchHeadForCausalLM(config).eval()
    model.save_pretrained(tmp_path)
    ids = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    torch.save(ids, tmp_path / "ids.pt")
    with torch.no_grad():
        torch.save(model(input_ids=ids).logits, tmp_path / "reference.pt")
    (tmp_path / "worker.py").write_text(WORKER)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(free_port()), str(tmp_path / "worker.py"), str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    inner = config.num_attention_heads * config.head_dim
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["max_diff"] < 1e-5, (rank, result["max_diff"])
        sharded = result["sharded"]
        assert sharded["model.layers.0.mlp.up_proj.weight"] == [config.intermediate_size // 2, config.hidden_size]
        assert sharded["model.layers.0.mlp.down_proj.weight"] == [config.hidden_size, config.intermediate_size // 2]
        if config.attention_type == "dense":
            assert sharded["model.layers.0.self_attn.q_proj.weight"] == [inner // 2, config.hidden_size]
            assert sharded["model.layers.0.self_attn.o_proj.weight"] == [config.hidden_size, inner // 2]
        else:  # expert tensors replicated
            assert "model.layers.0.self_attn.value_experts" not in sharded
