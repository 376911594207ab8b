"""One FSDP2 training process for tests/training/test_fsdp.py (run under torchrun, gloo, CPU; or alone without FSDP).

    torchrun --nproc_per_node 2 tests/training/fsdp_worker.py OUT --steps 8 [--save-every 2] [--resume]
    python tests/training/fsdp_worker.py OUT --steps 5 --no-fsdp          # the one-process reference, same global batch

Every decoder layer (`_no_split_modules`) is a `fully_shard` unit and the root module another, as Accelerate's
FSDP2 plugin wraps it. The global batch of a step is drawn from a generator seeded by the step; each process
takes its contiguous share of rows, so the processes together see exactly the one-process batch. Checkpoints are
`torch.distributed.checkpoint` folders of the sharded model and optimizer state, written to a temporary name and
renamed when complete. Each finished step appends `{"step", "loss"}` to OUT/losses.jsonl (rank 0).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time

import torch
import torch.distributed as dist

from switchhead import SwitchHeadConfig, SwitchHeadForCausalLM

GLOBAL_BATCH, LENGTH = 8, 32


def batch(step: int, vocab: int, rank: int, world: int) -> torch.Tensor:
    rows = torch.randint(0, vocab, (GLOBAL_BATCH, LENGTH), generator=torch.Generator().manual_seed(1000 + step))
    share = GLOBAL_BATCH // world
    return rows[rank * share:(rank + 1) * share]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--preset", default="tiny-switchall")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--save-every", type=int, default=0)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--no-fsdp", action="store_true")
    parser.add_argument("--no-entropy-reg", action="store_true",
                        help="entropy_reg_coef=0: the sigma-MoE regulariser is a per-process batch statistic")
    parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds to wait after each step")
    args = parser.parse_args()
    torch.use_deterministic_algorithms(True)

    distributed = not args.no_fsdp
    if distributed:
        dist.init_process_group("gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    torch.manual_seed(0)
    config = SwitchHeadConfig.from_preset(args.preset, **({"entropy_reg_coef": 0.0} if args.no_entropy_reg else {}))
    model = SwitchHeadForCausalLM(config)
    model.train()
    if distributed:
        from torch.distributed.fsdp import fully_shard

        for module in model.modules():
            if type(module).__name__ in model._no_split_modules:
                fully_shard(module)
        fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)

    checkpoints = os.path.join(args.out, "checkpoints")
    start = 0
    if args.resume:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        names = sorted(n for n in os.listdir(checkpoints) if n.startswith("step-"))
        folder = os.path.join(checkpoints, names[-1])
        model_state, optimizer_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optimizer_state}
        dcp.load(state, checkpoint_id=folder)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        start = int(names[-1].split("-")[1])
        if rank == 0:  # the log continues from the checkpoint: later lines belong to the killed attempt
            with open(os.path.join(args.out, "losses.jsonl")) as handle:
                kept = [line for line in handle if json.loads(line)["step"] <= start]
            with open(os.path.join(args.out, "losses.jsonl"), "w") as handle:
                handle.writelines(kept)

    for step in range(start + 1, args.steps + 1):
        input_ids = batch(step, config.vocab_size, rank, world)
        loss = model(input_ids=input_ids, labels=input_ids).loss  # mean over this process's tokens
        loss.backward()  # FSDP2 averages the gradients over processes: the global mean (equal shares)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        logged = loss.detach().clone()
        if distributed:
            dist.all_reduce(logged, op=dist.ReduceOp.SUM)
            logged /= world
        if rank == 0:
            with open(os.path.join(args.out, "losses.jsonl"), "a") as handle:
                handle.write(json.dumps({"step": step, "loss": logged.item()}) + "\n")
        if args.save_every and step % args.save_every == 0 and distributed:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict

            model_state, optimizer_state = get_state_dict(model, optimizer)
            temporary = os.path.join(checkpoints, f".tmp-step-{step:07d}")
            if rank == 0:
                shutil.rmtree(temporary, ignore_errors=True)
            dist.barrier()
            dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=temporary)
            dist.barrier()
            if rank == 0:
                os.replace(temporary, os.path.join(checkpoints, f"step-{step:07d}"))
            dist.barrier()
        if args.step_sleep:
            time.sleep(args.step_sleep)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
