"""What goes into the decoder stack and what comes out: checks of the caller's inputs, with errors that say what to
change, and the output classes (Transformers' MoE outputs with the XL memory added).

Shape checks only, and the vocabulary check on the CPU only: nothing here syncs with the host on an accelerator or
under torch.compile. Part of the Hub-ready model: it imports only torch and transformers.
"""

from dataclasses import dataclass

import torch
from torch import nn
from transformers.modeling_outputs import MoeCausalLMOutputWithPast, MoeModelOutputWithPast


def check_inputs(input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None) -> None:
    """Exactly one of `input_ids` `[batch, length]` and `inputs_embeds` `[batch, length, hidden_size]`, not empty."""
    if (input_ids is None) ^ (inputs_embeds is not None):
        raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
    given = input_ids if input_ids is not None else inputs_embeds
    name, layout, dims = ("input_ids", "[batch, length]", 2) if input_ids is not None else (
        "inputs_embeds", "[batch, length, hidden_size]", 3)
    if given.dim() != dims:
        hint = f" (one sequence: add a batch dimension, {name}[None])" if given.dim() == dims - 1 else ""
        raise ValueError(f"{name} must be shaped {layout}, got shape {tuple(given.shape)}{hint}")
    if given.shape[0] == 0 or given.shape[1] == 0:
        raise ValueError(f"{name} is empty (shape {tuple(given.shape)}): give at least one token per sequence, "
                         f"shaped {layout}")


def embed_tokens(embedding: nn.Embedding, input_ids: torch.Tensor) -> torch.Tensor:
    """`embedding(input_ids)`; on the CPU an id outside the vocabulary is a ValueError naming its size. On other
    devices and under torch.compile nothing is checked (a check would sync with the host every step)."""
    if input_ids.device.type != "cpu" or torch.compiler.is_compiling():
        return embedding(input_ids)
    try:
        return embedding(input_ids)
    except IndexError:
        raise ValueError(
            f"input_ids holds token ids outside the vocabulary: every id must be in [0, vocab_size="
            f"{embedding.num_embeddings}) (min {int(input_ids.min())}, max {int(input_ids.max())})"
        ) from None


@dataclass
class SwitchHeadModelOutputWithPast(MoeModelOutputWithPast):
    r"""
    xl_memory (`list[torch.Tensor]`, *optional*):
        One detached `[B, M, d]` tensor per layer: the last `config.xl_memory_length` positions of
        that layer's input hidden states (previous memory, then this segment). Pass it as
        `xl_memory=` with the next segment. Returned for XL models with `xl_memory_length > 0` when
        called without a KV cache (`use_cache=False`).
    """

    xl_memory: list[torch.Tensor] | None = None


@dataclass
class SwitchHeadCausalLMOutputWithPast(MoeCausalLMOutputWithPast):
    r"""
    xl_memory (`list[torch.Tensor]`, *optional*):
        The XL memory for the next segment; see `SwitchHeadModelOutputWithPast.xl_memory`.
    """

    xl_memory: list[torch.Tensor] | None = None
