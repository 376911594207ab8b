"""A push_to_hub-ready model folder saved by this package, for the pipeline and clean-environment tests.

`save_hub_folder(path, preset)` writes a tiny randomly initialised model the way a user would publish one:
config.json with `auto_map`, generation_config.json, the weights, the copied modeling and configuration files, and a
GPT-2 byte-level BPE tokenizer built from the shared vocab.json / merges.txt (no Hub download).
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import torch
from transformers import GPT2Tokenizer

from switchhead import SwitchHeadConfig, SwitchHeadForCausalLM

from helpers.data import require

GPT2 = "tokenizers/gpt2"
# files a user's Hub repository needs so that `from_pretrained(repo, trust_remote_code=True)` works anywhere
HUB_FILES = ("config.json", "generation_config.json", "model.safetensors", "configuration_switchhead.py",
             "modeling_switchhead.py", "expert_ops.py", "positions.py", "tensor_parallel.py", "checkpoint_format.py",
             "transformers_compat.py", "experts_integration.py", "tokenizer.json", "tokenizer_config.json")


@functools.lru_cache(maxsize=1)  # building the fast tokenizer from vocab/merges takes ~10 s; do it once per run
def gpt2_tokenizer() -> GPT2Tokenizer:
    """The GPT-2 tokenizer of the test data (the calling test is skipped where it is missing: helpers/data.py)."""
    return GPT2Tokenizer.from_pretrained(require(GPT2) / GPT2)  # a local folder: no Hub access


def save_hub_folder(path: Path, preset: str = "tiny-switchall", seed: int = 0) -> SwitchHeadForCausalLM:
    """Save a tiny model plus tokenizer to `path`; returns the model (eval mode) as saved."""
    tokenizer = copy.deepcopy(gpt2_tokenizer())
    tokenizer.pad_token = tokenizer.eos_token  # GPT-2 has no pad token; batched pipelines need one
    tokenizer.padding_side = "left"  # decoder-only generation pads on the left
    eos = tokenizer.eos_token_id
    config = SwitchHeadConfig.from_preset(preset, vocab_size=len(tokenizer), bos_token_id=eos, eos_token_id=eos,
                                          pad_token_id=eos)
    torch.manual_seed(seed)
    model = SwitchHeadForCausalLM(config).eval()
    model.generation_config.max_new_tokens = 16
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model
