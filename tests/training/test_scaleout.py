"""Training on Transformers' own distributed engine: `from_pretrained(..., distributed_config=DistributedConfig(...))`
under `torchrun --nproc_per_node 2` (gloo, CPU), against one process (tests/training/scaleout_worker.py).

- fsdp_size=2 + ep_size=2 (SwitchAll: `base_model_ep_plan` puts 4 of the 8 sigma-MoE experts on each process,
  Transformers' all-to-all dispatch brings them their tokens; the rest FSDP2) and tp_size=2 (SwitchAll, and XL
  SwitchHead: attention split by head) train 3 SGD steps with the same per-process losses as one process within
  1e-5 and the same final weights within 1e-6 (fp32; the sums are only reordered). The sigma-MoE entropy regulariser
  is on (coefficient 0.001): it is a statistic of each data-parallel process's batch, which the reference runs as
  micro-batches of one step. The fsdp_size=2 + ep_size=2 run accumulates 2 micro-batches per process per step.
  Dropout is off (each process would draw its own masks).
- On 4 processes, tp_size=2 + fsdp_size=2 (two data-parallel shares, each split by head / expert rows) and HSDP
  (dp_replicate_size=2 + fsdp_size=2: four shares) train SwitchAll like one process, within the same tolerances.
- A run saved by 2 processes after step 2 (rank-local shards, `save_pretrained(..., distributed_checkpoint=True)`,
  and `save_optimizer_distributed`) resumes on 2 processes with the uninterrupted step 3 loss and weights; the
  `save_pretrained` folder the sharded model writes loads in one process with its logits.
- Refused at load with the reason: ep_size > 1 for a model without a sigma-MoE MLP, an `ep_plan` rule naming
  attention; pipeline parallelism (inference only in Transformers) refuses a training forward. Inference under
  tp_size=2 + ep_size=2 (Transformers' all-reduce dispatch: routes to the other process's experts arrive as sentinel
  ids with gate 0) gives one process's logits within 1e-5.
Skipped on Transformers releases without expert parallelism (no `transformers.distributed.expert_parallel`, e.g. 5.17).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers.models import logits_of, tiny_model
from helpers.network import free_port

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers.distributed.expert_parallel") is None,
                                reason="this Transformers release has no expert parallelism in its distributed engine")

WORKER = str(Path(__file__).with_name("scaleout_worker.py"))
NO_DROPOUT = {"hidden_dropout": 0.0, "attention_dropout": 0.0, "mlp_expert_dropout": 0.0,
              "attention_expert_dropout": 0.0}
LOSS_TOLERANCE, WEIGHT_TOLERANCE = 1e-5, 1e-6


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def _saved(preset: str, folder: Path) -> Path:
    model = tiny_model(preset, **NO_DROPOUT)
    assert model.config.mlp_type != "sigma_moe" or model.config.entropy_reg_coef > 0
    model.save_pretrained(folder)
    return folder


def _run(model: Path, out: Path, layout: dict, *extra: str) -> dict:
    """The worker on 2 processes (a layout) or one (no layout); its per-rank results."""
    out.mkdir(parents=True, exist_ok=True)
    command = [WORKER, str(model), str(out), "--layout", json.dumps(layout), *extra]
    # ep_size divides the FSDP processes (fsdp_size=2 + ep_size=2 runs on 2), so it adds none
    processes = math.prod(layout.get(size, 1) for size in ("tp_size", "fsdp_size", "dp_replicate_size"))
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes),
                "--master_port", str(free_port())] if layout else [sys.executable]
    done = subprocess.run(launcher + command, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    ranks = tuple(range(processes))
    return {rank: json.loads((out / f"rank{rank}.json").read_text()) for rank in ranks}


def _assert_same_training(distributed: dict, reference: dict, out: Path, reference_out: Path) -> None:
    for rank, result in distributed.items():
        expected = [[losses[part] for part in result["parts"]] for losses in reference[0]["losses"]]
        assert len(result["losses"]) == len(expected) > 0
        for step, (got, wanted) in enumerate(zip(result["losses"], expected)):
            for a, b in zip(got, wanted, strict=True):
                assert abs(a - b) <= LOSS_TOLERANCE * abs(b), (rank, step, a, b)
    weights, expected = torch.load(out / "weights.pt"), torch.load(reference_out / "weights.pt")
    assert weights.keys() == expected.keys()
    wrong = {name: (weights[name] - expected[name]).abs().max().item() for name in expected
             if not torch.allclose(weights[name], expected[name], rtol=0, atol=WEIGHT_TOLERANCE)}
    assert not wrong, wrong


def _assert_trained(weights_file: Path, initial: Path) -> None:
    """Every parameter moved from its initial value (the comparison above is not of untouched weights)."""
    from switchhead import SwitchHeadForCausalLM

    start = dict(SwitchHeadForCausalLM.from_pretrained(initial).named_parameters())
    still = [name for name, tensor in torch.load(weights_file).items() if torch.equal(tensor, start[name].detach())]
    assert not still, still


@pytest.mark.integration
def test_fsdp_and_expert_parallel_train_resume_and_save_like_one_process(tmp_path):
    model = _saved("tiny-switchall", tmp_path / "init")
    layout = {"fsdp_size": 2, "ep_size": 2}
    reference = _run(model, tmp_path / "reference", {}, "--data-parallel", "2", "--accumulate", "2")
    distributed = _run(model, tmp_path / "ep", layout, "--accumulate", "2", "--save-at", "2", "--save-folder")
    _assert_same_training(distributed, reference, tmp_path / "ep", tmp_path / "reference")
    _assert_trained(tmp_path / "ep" / "weights.pt", model)
    # the experts were really split: each process's checkpoint shard holds half of each layer's experts
    from safetensors import safe_open

    shards = sorted((tmp_path / "ep" / "checkpoint" / "model").glob("*.safetensors"))
    assert len(shards) == 2
    with safe_open(str(shards[0]), "pt") as handle:
        experts = [handle.get_slice(key).get_shape() for key in handle.keys() if key.endswith("expert_keys")]
    assert experts and all(shape[0] == 4 for shape in experts), experts  # 8 experts, 4 per process

    # resumed after step 2 on 2 processes: step 3 as in the uninterrupted run
    resumed = _run(model, tmp_path / "resumed", layout, "--accumulate", "2",
                   "--resume-from", str(tmp_path / "ep" / "checkpoint"))
    for rank in (0, 1):
        assert resumed[rank]["losses"] == [distributed[rank]["losses"][-1]], rank
    assert all(torch.equal(a, b) for a, b in zip(torch.load(tmp_path / "resumed" / "weights.pt").values(),
                                                 torch.load(tmp_path / "ep" / "weights.pt").values()))

    # the folder the sharded model saved loads in one process, with the same logits
    from switchhead import SwitchHeadForCausalLM

    loaded = SwitchHeadForCausalLM.from_pretrained(tmp_path / "ep" / "folder")
    ids = torch.randint(0, loaded.config.vocab_size, (4, 16), generator=torch.Generator().manual_seed(1000))
    torch.testing.assert_close(logits_of(loaded, ids), torch.load(tmp_path / "ep" / "logits.pt"), rtol=0, atol=1e-5)


@pytest.mark.integration
@pytest.mark.parametrize("preset", ["tiny-switchall", "tiny-switchhead-xl"])
def test_tensor_parallel_trains_like_one_process(tmp_path, preset):
    model = _saved(preset, tmp_path / "init")
    reference = _run(model, tmp_path / "reference", {})
    distributed = _run(model, tmp_path / "tp", {"tp_size": 2})
    _assert_same_training(distributed, reference, tmp_path / "tp", tmp_path / "reference")
    _assert_trained(tmp_path / "tp" / "weights.pt", model)


@pytest.mark.integration
@pytest.mark.parametrize("layout", [{"tp_size": 2, "fsdp_size": 2}, {"dp_replicate_size": 2, "fsdp_size": 2}],
                         ids=["tp2-fsdp2", "hsdp2x2"])
def test_four_process_layouts_train_like_one_process(tmp_path, layout):
    # 4 processes: TP inside FSDP2 (two data-parallel shares, each split by head / by expert rows), and HSDP (two
    # replicas of a 2-way FSDP2 shard group: four data-parallel shares)
    model = _saved("tiny-switchall", tmp_path / "init")
    shares = layout.get("dp_replicate_size", 1) * layout["fsdp_size"]
    reference = _run(model, tmp_path / "reference", {}, "--data-parallel", str(shares))
    distributed = _run(model, tmp_path / "run", layout)
    assert len(distributed) == 4
    _assert_same_training(distributed, reference, tmp_path / "run", tmp_path / "reference")
    _assert_trained(tmp_path / "run" / "weights.pt", model)


REFUSALS = r'''
import json, sys, torch
from transformers import DistributedConfig
from switchhead import SwitchHeadForCausalLM
folders, out = json.loads(sys.argv[1]), sys.argv[2]
errors = {}
for name, folder, layout in (
        ("dense_mlp_ep", folders["switchhead"], {"fsdp_size": 2, "ep_size": 2}),
        ("attention_ep", folders["switchall"], {"fsdp_size": 2, "ep_size": 2,
                                                "ep_plan": {"layers.*.self_attn": "ep_dispatch_experts"}})):
    try:
        SwitchHeadForCausalLM.from_pretrained(folder, distributed_config=DistributedConfig(**layout))
        errors[name] = None
    except ValueError as error:
        errors[name] = str(error)
model = SwitchHeadForCausalLM.from_pretrained(folders["switchall"], distributed_config=DistributedConfig(pp_size=2))
ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    errors["pp_inference_logits"] = list(model.eval()(input_ids=ids).logits.shape)
try:
    model.train()(input_ids=ids, labels=ids)
    errors["pp_training"] = None
except RuntimeError as error:
    errors["pp_training"] = str(error)
# inference under tp_size=2, ep_size=2: Transformers' all-reduce dispatch, other processes' experts as sentinel ids
single = SwitchHeadForCausalLM.from_pretrained(folders["switchall"]).eval()
sharded = SwitchHeadForCausalLM.from_pretrained(folders["switchall"],
                                                distributed_config=DistributedConfig(tp_size=2, ep_size=2)).eval()
with torch.no_grad():
    errors["tp_ep_inference_diff"] = (sharded(input_ids=ids).logits - single(input_ids=ids).logits).abs().max().item()
if torch.distributed.get_rank() == 0:
    open(out, "w").write(json.dumps(errors))
'''


@pytest.mark.integration
def test_unsupported_layouts_are_refused_with_the_reason(tmp_path):
    # (folders not named `switchhead`: beside the script, that name would shadow the package)
    folders = {"switchall": str(_saved("tiny-switchall", tmp_path / "switchall-model")),
               "switchhead": str(_saved("tiny-switchhead", tmp_path / "switchhead-model"))}
    (tmp_path / "refusals.py").write_text(REFUSALS)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(free_port()), str(tmp_path / "refusals.py"), json.dumps(folders),
                           str(tmp_path / "errors.json")], env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    errors = json.loads((tmp_path / "errors.json").read_text())
    assert "expert parallelism shards the sigma-MoE feed-forward experts" in errors["dense_mlp_ep"]
    assert "name attention" in errors["attention_ep"], errors["attention_ep"]
    assert errors["pp_inference_logits"] == [2, 8, 512]
    assert "runs inference only" in errors["pp_training"]
    assert errors["tp_ep_inference_diff"] < 1e-5
