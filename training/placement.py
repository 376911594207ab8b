"""Where a run's model lives and who writes its state: Accelerate's placement (one process, DDP, FSDP through
`accelerator.prepare`) or Transformers' distributed engine (`from_pretrained(..., distributed_config=
DistributedConfig(tp_size=, fsdp_size=, ep_size=))`, driven by the config's `base_model_tp_plan` /
`base_model_ep_plan`). `placement_for` chooses once; the loop, the checkpoints and the final save ask the placement
and never which one it is.

    placement = placement_for(config, accelerator)
    model = placement.place(SwitchHeadForCausalLM(model_config))      # sharded (engine) or as is (Accelerate)
    optimizer = AdamW(model.parameters(), ..., **placement.optimizer_options)
    model, optimizer = placement.prepare(model, optimizer)
    rows = batches.micro_batch(step, micro, placement.data_index, placement.data_count, accumulation)
    placement.save_state(folder) / placement.load_state(folder)     # a checkpoint's model and optimizer
    placement.full_state_dict(model), placement.saveable(model)      # the final save_pretrained folder

Under the engine, rank 0 alone writes: a checkpoint's model and optimizer are gathered whole (torch's
`get_model_state_dict` / `get_optimizer_state_dict` with `full_state_dict=True`, as Transformers'
`gather_full_state_dict` does for the model) and written by rank 0 as `model.safetensors` and `optimizer.bin`, the
file names Accelerate's `save_state` uses; a resume loads them back into the sharded model and optimizer
(`set_model_state_dict` / `set_optimizer_state_dict`), on the same sizes (they are settings of the run).
"""

from __future__ import annotations

import copy
import os

import torch

from .errors import TrainingError

# the sizes `switchhead train` takes, in Transformers' names (DistributedConfig fields)
SIZES = ("tp_size", "fsdp_size", "ep_size")
MODEL_FILE, OPTIMIZER_FILE = "model.safetensors", "optimizer.bin"


def launched_processes() -> int | None:
    """WORLD_SIZE of a launcher (torchrun, `accelerate launch`), or None when no launcher started this process."""
    value = os.environ.get("WORLD_SIZE")
    return int(value) if value and value.isdigit() else None


# how long the launched processes may take to find each other before the run stops (seconds); the collectives of
# the joined run keep torch's own timeouts
JOIN_TIMEOUT_ENV, DEFAULT_JOIN_TIMEOUT = "SWITCHHEAD_JOIN_TIMEOUT", 60.0


class ProcessesMissing(TrainingError):
    """The launched processes did not all join in time: every process reports it (rank 0 may be the missing one)."""


def join_timeout() -> float:
    """Seconds to wait for every launched process to join (SWITCHHEAD_JOIN_TIMEOUT, default 60)."""
    raw = os.environ.get(JOIN_TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_JOIN_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not (value == value and 0 < value <= 86400):
        raise TrainingError(f"{JOIN_TIMEOUT_ENV} must be a number of seconds in (0, 86400], got {raw!r}")
    return value


def start_accelerator(**options):
    """`Accelerator(**options)` whose process group must form within `join_timeout()` seconds: a launched process
    whose peers never start (`WORLD_SIZE=2 RANK=0` alone, a node that did not come up) stops with a TrainingError
    instead of waiting torch's default 30 minutes. Once joined, the group's collectives get torch's default timeout
    back (a checkpoint written by rank 0 may keep the others waiting longer than the join allows)."""
    from datetime import timedelta

    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    launched = launched_processes()
    if launched is None or launched < 2 or torch.distributed.is_initialized():
        return Accelerator(**options)
    seconds = join_timeout()
    try:
        with _stderr_held_back() as held:  # torch's C++ store logs each failed connection try on stderr
            accelerator = Accelerator(kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=seconds))],
                                      **options)
        held.replay()
    except (RuntimeError, TimeoutError) as error:  # DistStoreError / DistNetworkError are RuntimeErrors
        text = str(error).lower()
        if not isinstance(error, TimeoutError) and "timed out" not in text and "timeout" not in text \
                and type(error).__name__ not in ("DistStoreError", "DistNetworkError"):
            raise
        rank = os.environ.get("RANK", "?")
        raise ProcessesMissing(f"process {rank} of {launched}: the other launched processes did not join within "
                            f"{seconds:g} s (WORLD_SIZE={launched}); start all of them (torchrun --nproc_per_node "
                            f"N starts them for you), or set {JOIN_TIMEOUT_ENV} to wait longer") from None
    if torch.distributed.is_initialized():
        from torch.distributed import constants
        from torch.distributed.distributed_c10d import _set_pg_timeout

        nccl = torch.distributed.get_backend() == "nccl"
        _set_pg_timeout(constants.default_pg_nccl_timeout if nccl else constants.default_pg_timeout)
    return accelerator


class _stderr_held_back:
    """Collect what is written to file descriptor 2 (C++ logs included) in the body; `replay()` writes it out after
    a success, a failure drops it: its one-line error says what happened."""

    def __enter__(self):
        import sys
        import tempfile

        sys.stderr.flush()
        self.file = tempfile.TemporaryFile()
        self.saved = os.dup(2)
        os.dup2(self.file.fileno(), 2)
        return self

    def __exit__(self, *exc):
        import sys

        sys.stderr.flush()
        os.dup2(self.saved, 2)
        os.close(self.saved)
        return False

    def replay(self) -> None:
        import sys

        self.file.seek(0)
        text = self.file.read()
        self.file.close()
        if text:
            sys.stderr.write(text.decode("utf-8", "replace"))
            sys.stderr.flush()


def check_sizes(sizes: dict[str, int], model_config=None) -> None:
    """TrainingError saying what to change when `sizes` cannot shard this run: a size that is not a positive
    integer, a product that is not the number of launched processes (or no launcher), what DistributedConfig
    refuses, and what the model's plans refuse at load (`check_parallel_plans`; experts or heads that do not
    divide). Runs in every process before anything is written."""
    if not sizes:
        return
    unknown = sorted(set(sizes) - set(SIZES))
    if unknown:
        raise TrainingError(f"distributed: unknown size(s) {', '.join(unknown)}; known: {', '.join(SIZES)}")
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise TrainingError(f"--{name.replace('_', '-')} must be an integer >= 1, got {value!r}")
    tp, fsdp, ep = (sizes.get(name, 1) for name in SIZES)
    options = " x ".join(f"--{name.replace('_', '-')} {sizes[name]}" for name in SIZES if name in sizes)
    launched = launched_processes()
    if launched is None:
        raise TrainingError(f"{options} shard the model over {tp * fsdp} processes: start them with `torchrun "
                            f"--nproc_per_node {tp * fsdp} -m switchhead.cli train ...` (or `accelerate launch "
                            f"--multi_gpu --num_processes {tp * fsdp} -m switchhead.cli train ...`)")
    if tp * fsdp != launched:
        raise TrainingError(f"--tp-size x --fsdp-size must equal the {launched} launched processes, got {tp} x {fsdp} "
                            f"= {tp * fsdp}: change the sizes or the launcher's process count (--ep-size splits the "
                            "sigma-MoE experts within those processes and does not count)")
    from transformers import DistributedConfig

    try:
        distributed = DistributedConfig(**sizes)
    except (TypeError, ValueError) as error:
        raise TrainingError(f"{options}: {error}") from None
    if model_config is None:
        return
    from ..tensor_parallel import SPLIT_ATTENTION_REGULARISER, check_parallel_plans, splits_attention_regulariser

    try:
        check_parallel_plans(model_config, distributed, None)
    except ValueError as error:
        raise TrainingError(f"{options}: {error}") from None
    if tp > 1 and splits_attention_regulariser(model_config):
        raise TrainingError(f"--tp-size {tp}: {SPLIT_ATTENTION_REGULARISER}")
    if model_config.num_attention_heads % tp:
        raise TrainingError(f"--tp-size {tp} splits attention by head: num_attention_heads "
                            f"({model_config.num_attention_heads}) must be divisible by it")
    if ep > 1 and model_config.num_mlp_experts % ep:
        raise TrainingError(f"--ep-size {ep} splits the sigma-MoE experts: num_mlp_experts "
                            f"({model_config.num_mlp_experts}) must be divisible by it")


class AcceleratePlacement:
    """The model as Accelerate prepares it: as is in one process, wrapped in DDP or FSDP by `prepare` for several.
    Every process sees its own rows of the global batch."""

    optimizer_options: dict = {}

    def __init__(self, accelerator):
        self.accelerator = accelerator
        self.data_index, self.data_count = accelerator.process_index, accelerator.num_processes

    def place(self, model):
        return model

    def prepare(self, model, optimizer):
        return self.accelerator.prepare(model, optimizer)

    def save_state(self, folder: str) -> None:
        """Model and optimizer (Accelerate's `save_state`; its pickled RNG file is replaced by ours, see
        `checkpoint_files`)."""
        from .checkpoint_files import LEGACY_RNG_FILE

        self.accelerator.save_state(folder)
        legacy = os.path.join(folder, LEGACY_RNG_FILE.format(self.accelerator.process_index))
        if os.path.exists(legacy):
            os.remove(legacy)

    def load_state(self, folder: str) -> None:
        # model (safetensors) and optimizer (torch's restricted loader); Accelerate also tries its pickled RNG
        # file, with the same restricted loader, and says nothing when there is none: ours is restored separately
        self.accelerator.load_state(folder)

    def full_state_dict(self, model) -> dict:
        return self.accelerator.get_state_dict(model)  # gathers the full weights under FSDP; every process calls it

    def saveable(self, model):
        return self.accelerator.unwrap_model(model)


class EnginePlacement:
    """The model sharded by Transformers' distributed engine at load (`from_pretrained(None, config=...,
    state_dict=..., distributed_config=DistributedConfig(**sizes))` of the seeded initial weights): it owns its
    placement and gradient reduction, so Accelerate only prepares the optimizer and autocast (as Transformers'
    Trainer does with such models). The processes of a tensor-parallel group share their rows of the batch."""

    optimizer_options = {"foreach": False}  # DTensor and plain parameters (TP) do not mix in the multi-tensor path

    def __init__(self, accelerator, sizes: dict[str, int]):
        if accelerator.distributed_type.value in ("FSDP", "DEEPSPEED", "MEGATRON_LM"):
            raise TrainingError(f"--tp-size / --fsdp-size / --ep-size shard the model with Transformers' engine, and "
                                f"this Accelerate config ({accelerator.distributed_type.value}) would shard it again: "
                                "launch with torchrun or a multi-GPU Accelerate config")
        self.accelerator, self.sizes = accelerator, dict(sizes)
        tp = self.sizes.get("tp_size", 1)
        self.data_index, self.data_count = accelerator.process_index // tp, accelerator.num_processes // tp
        self.model = self.optimizer = None

    def place(self, model):
        from transformers import DistributedConfig

        config = copy.deepcopy(model.config)  # from_pretrained attaches the DistributedConfig to the one it gets
        try:
            return type(model).from_pretrained(None, config=config, state_dict=model.state_dict(),
                                               distributed_config=DistributedConfig(**self.sizes))
        except ValueError as error:  # a layout the engine or the model's plans refuse at load
            raise TrainingError(f"distributed sizes {self.sizes}: {str(error).splitlines()[0]}") from None

    def prepare(self, model, optimizer):
        self.model, self.optimizer = model, optimizer
        model = self.accelerator.prepare_model(model, device_placement=False, evaluation_mode=True)
        return model, self.accelerator.prepare(optimizer)

    def _options(self, **extra):
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(full_state_dict=True, **extra)

    def save_state(self, folder: str) -> None:
        """The model and the optimizer gathered whole (every process takes part), written by rank 0."""
        from safetensors.torch import save_file
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        model_state = self.full_state_dict(self.model)
        optimizer_state = get_optimizer_state_dict(self.model, self.optimizer, options=self._options(cpu_offload=True))
        if self.accelerator.is_main_process:
            save_file(_unshared(model_state), os.path.join(folder, MODEL_FILE))
            torch.save(optimizer_state, os.path.join(folder, OPTIMIZER_FILE))

    def load_state(self, folder: str) -> None:
        """`save_state`'s files into this process's shards (read by every process; nothing is written)."""
        from safetensors.torch import load_file
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        set_model_state_dict(self.model, load_file(os.path.join(folder, MODEL_FILE)), options=self._options())
        optimizer_state = torch.load(os.path.join(folder, OPTIMIZER_FILE), map_location="cpu", weights_only=True)
        set_optimizer_state_dict(self.model, self.optimizer, optimizer_state, options=self._options())

    def full_state_dict(self, model) -> dict:
        """Every parameter whole, on rank 0 (the other processes get {}); every process calls it."""
        from transformers.distributed import gather_full_state_dict

        return gather_full_state_dict(self.model if self.model is not None else model)

    def saveable(self, model):
        """A twin of the model on the meta device, whose `save_pretrained(folder, state_dict=...)` writes the gathered
        weights from rank 0 alone (the sharded model's own `save_pretrained` is a collective of every process)."""
        config = copy.deepcopy(model.config)
        config.distributed_config = None
        from torch.distributed.fsdp import FSDPModule

        # FSDP2 turns the model into an instance of a subclass of (FSDPModule, its class): take its own class
        cls = next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))
        with torch.device("meta"):
            return cls(config)


def _unshared(state: dict) -> dict:
    """The state dict with tensors that share storage (tied weights) copied apart, as safetensors requires."""
    seen, out = set(), {}
    for name, tensor in state.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset()) if tensor.numel() else None
        out[name] = tensor.clone() if key in seen else tensor.contiguous()
        seen.add(key)
    return out


def placement_for(config, accelerator):
    """The engine when the run has distributed sizes, else Accelerate."""
    return EnginePlacement(accelerator, config.distributed) if config.distributed else AcceleratePlacement(accelerator)
