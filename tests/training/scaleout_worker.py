"""One training process for tests/training/test_scaleout.py: a saved tiny model loaded with Transformers' distributed
engine (`from_pretrained(..., distributed_config=DistributedConfig(...))`, under torchrun, gloo, CPU), or alone as
the one-process reference.

    torchrun --nproc_per_node 2 tests/training/scaleout_worker.py MODEL OUT --layout '{"fsdp_size": 2, "ep_size": 2}'
    torchrun --nproc_per_node 4 tests/training/scaleout_worker.py MODEL OUT --layout '{"tp_size": 2, "fsdp_size": 2}'
    python tests/training/scaleout_worker.py MODEL OUT --layout '{}' --data-parallel 2     # the reference

Step s draws a global batch from a generator seeded by s and cuts it into `data_parallel` equal shares, each of
`accumulate` micro-batches. A distributed process trains on its data-parallel group's share (processes of one
tensor-parallel group share one), accumulating the gradients of its micro-batches (each loss divided by their
count); FSDP averages the gradients over the data-parallel processes. The reference runs all micro-batches of the
step, each loss divided by their count: the same gradient, the sigma-MoE entropy regulariser included, which is a
statistic of each micro-batch (as under DDP with gradient accumulation). SGD with momentum, so that the final weights differ from the
reference only by the rounding of the gradients.

Writes OUT/rank{R}.json: each step's micro-batch losses, and the micro-batches' indices in the global batch. With --save-at K: after step K the
model is saved as rank-local shards (`save_pretrained(..., distributed_checkpoint=True)`) and the optimizer with
`save_optimizer_distributed`, to OUT/checkpoint; with --resume-from DIR the run loads both from DIR and continues
after step K. Rank 0 writes OUT/weights.pt (every parameter gathered whole) and, with --save-folder, the process
group's `save_pretrained` folder plus the logits of OUT's probe ids (OUT/logits.pt).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist

from switchhead import SwitchHeadForCausalLM

GLOBAL_BATCH, LENGTH, LR = 4, 16, 0.05


def share(step: int, vocab: int, index: int, count: int) -> torch.Tensor:
    rows = torch.randint(0, vocab, (GLOBAL_BATCH, LENGTH), generator=torch.Generator().manual_seed(1000 + step))
    size = GLOBAL_BATCH // count
    return rows[index * size:(index + 1) * size]


def full(tensor: torch.Tensor) -> torch.Tensor:
    """A parameter whole: a DTensor gathered from its shards (a collective: every process calls it in order)."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("out")
    parser.add_argument("--layout", default="{}", help="DistributedConfig fields as JSON; {} runs one process")
    parser.add_argument("--data-parallel", type=int, default=1, help="the reference: the shares of a step")
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per share (gradient accumulation)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--save-at", type=int, default=0)
    parser.add_argument("--resume-from", default=None)
    parser.add_argument("--save-folder", action="store_true")
    args = parser.parse_args()
    torch.use_deterministic_algorithms(True)
    layout = json.loads(args.layout)

    start = 0
    source = args.model
    if args.resume_from:
        source = os.path.join(args.resume_from, "model")
        start = json.loads(open(os.path.join(args.resume_from, "step.json")).read())["step"]
    if layout:
        from transformers import DistributedConfig

        model = SwitchHeadForCausalLM.from_pretrained(source, distributed_config=DistributedConfig(**layout))
        rank = dist.get_rank()
        # Transformers' mesh is (pp, dp_replicate, fsdp, tp), tp innermost: processes rank // tp_size see one
        # data-parallel share (HSDP: replicas x FSDP shards, each its own share)
        shares = layout.get("dp_replicate_size", 1) * layout.get("fsdp_size", 1)
        index = (rank // layout.get("tp_size", 1)) % shares
    else:
        model = SwitchHeadForCausalLM.from_pretrained(source)
        rank, shares, index = 0, args.data_parallel, None
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9, foreach=False)
    if args.resume_from and layout:
        from transformers.distributed import load_optimizer_distributed

        load_optimizer_distributed(model, optimizer, os.path.join(args.resume_from, "optimizer"))

    losses = []
    vocab = model.config.vocab_size
    for step in range(start + 1, args.steps + 1):
        parts = shares * args.accumulate  # micro-batches of the global batch; a share is `accumulate` of them
        indices = range(parts) if index is None else range(index * args.accumulate, (index + 1) * args.accumulate)
        step_losses = []
        for part in indices:
            ids = share(step, vocab, part, parts)
            loss = model(input_ids=ids, labels=ids).loss  # cross-entropy + entropy regulariser (training)
            (loss / len(indices)).backward()
            step_losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(step_losses)
        if step == args.save_at and layout:
            from transformers.distributed import save_optimizer_distributed

            folder = os.path.join(args.out, "checkpoint")
            model.save_pretrained(os.path.join(folder, "model"), distributed_checkpoint=True)
            save_optimizer_distributed(model, optimizer, os.path.join(folder, "optimizer"))
            if rank == 0:
                model.config.save_pretrained(os.path.join(folder, "model"))
                with open(os.path.join(folder, "step.json"), "w") as handle:
                    json.dump({"step": step}, handle)
            dist.barrier()

    weights = {name: full(parameter.detach()).clone() for name, parameter in model.named_parameters()}
    if args.save_folder and layout:
        model.save_pretrained(os.path.join(args.out, "folder"))  # gathered whole, written by rank 0
        ids = share(0, vocab, 0, 1)
        model.eval()
        with torch.no_grad():
            logits = model(input_ids=ids).logits
        if rank == 0:
            torch.save(logits, os.path.join(args.out, "logits.pt"))
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as handle:
        json.dump({"losses": losses, "parts": list(indices)}, handle)
    if rank == 0:
        torch.save(weights, os.path.join(args.out, "weights.pt"))
    if layout:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
