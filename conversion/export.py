"""Export to `torch.export` programs and ONNX files with a dynamic batch and sequence length.

    from switchhead.conversion.export import check_onnx, to_onnx
    to_onnx(model, "model.onnx")     # inputs input_ids, attention_mask [batch, sequence]; output logits
    check_onnx("model.onnx", model)  # onnxruntime against PyTorch at several shapes: the largest difference

CLI: `switchhead export MODEL_DIR model.onnx [--check]`.

What is exported: one forward without a KV cache (`use_cache=False`) from token ids and a padding mask (left or right
padding) to the logits, `LogitsOnly`; for a causal LM, a task model with `logits` (sequence or token
classification) alike. The batch and the sequence length are symbols of the graph (`torch.export.Dim`), so one file
serves every shape up to `max_position_embeddings` tokens; the expert projections run as "all_experts" in it
(`expert_ops.choose_formulation`). Every variant exports: RoPE and XL, SwitchHead, dense and SwitchAll.

Not exported: the KV cache (decoding token by token re-runs the whole prefix), XL memory across segments, router
logits, and the Triton kernels (the graph holds the PyTorch formulations); `to_onnx` writes one file, so models up
to protobuf's 2 GB (weights included). ONNX needs `onnx` and `onnxscript` (`pip install -e ".[test]"` pins them);
`check_onnx` needs `onnxruntime`.
"""

from __future__ import annotations

import torch
from torch import nn

from .checkpoint_io import ConversionError, atomic_output

# shapes `check_onnx` runs by default: one token, a short and a long batch (a left-padded row in each batch)
CHECK_SHAPES = ((1, 1), (2, 7), (3, 16))
# the lowest opset our graphs can be written in: LayerNormalization is an ONNX operator from opset 17 on
MIN_OPSET = 17


def supported_opsets() -> range:
    """The opsets `to_onnx` accepts: MIN_OPSET up to the newest the installed onnx knows."""
    onnx = _require_onnx()
    return range(MIN_OPSET, onnx.defs.onnx_opset_version() + 1)


def _require_onnx():
    try:
        import onnx
        import onnxscript  # noqa: F401
    except ImportError as error:
        raise ConversionError(f"ONNX export needs onnx and onnxscript ({error.name} is missing): "
                              f"pip install onnx==1.23.2 onnxscript==0.7.2") from None
    return onnx


class LogitsOnly(nn.Module):
    """`model(input_ids, attention_mask, use_cache=False).logits`: the forward that export traces."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits


def _example(config, batch: int = 2, length: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, config.vocab_size, (batch, min(length, config.max_position_embeddings)),
                        generator=torch.Generator().manual_seed(0))
    return ids, torch.ones_like(ids)


def _dynamic_shapes(config) -> dict:
    batch = torch.export.Dim("batch")
    sequence = torch.export.Dim("sequence", max=config.max_position_embeddings)
    return {"input_ids": {0: batch, 1: sequence}, "attention_mask": {0: batch, 1: sequence}}


def export_program(model: nn.Module) -> torch.export.ExportedProgram:
    """`torch.export.export` of `LogitsOnly(model)` (in eval mode) with a dynamic batch and sequence length."""
    model.eval()
    return torch.export.export(LogitsOnly(model).eval(), _example(model.config),
                               dynamic_shapes=_dynamic_shapes(model.config))


def to_onnx(model: nn.Module, path: str, opset_version: int | None = None, overwrite: bool = False) -> str:
    """Write `LogitsOnly(model)` as an ONNX file with a dynamic batch and sequence length (torch's dynamo exporter,
    `torch.onnx.export(..., dynamo=True)`); returns the path. Inputs `input_ids` and `attention_mask` (int64
    `[batch, sequence]`), output `logits`. Refuses an existing `path` unless `overwrite`, which replaces it by a
    rename once the new file is complete; nothing is left behind on failure. `opset_version` must be one of
    `supported_opsets()`, and the file is written in exactly that opset or not at all (torch's exporter falls back to
    its own opset, with a warning only, where it cannot convert)."""
    opsets = supported_opsets()
    if opset_version is not None and opset_version not in opsets:
        raise ConversionError(f"opset {opset_version} is not one this exporter can write; choose {opsets.start} to "
                              f"{opsets.stop - 1}, or leave it out")
    model.eval()
    with atomic_output(path, is_dir=False, overwrite=overwrite) as staging:
        program = torch.onnx.export(LogitsOnly(model).eval(), _example(model.config), dynamo=True, verbose=False,
                                    dynamic_shapes=_dynamic_shapes(model.config), opset_version=opset_version,
                                    input_names=["input_ids", "attention_mask"], output_names=["logits"])
        written = [entry.version for entry in program.model_proto.opset_import if entry.domain in ("", "ai.onnx")]
        if opset_version is not None and written != [opset_version]:
            raise ConversionError(f"the exporter could not convert the graph to opset {opset_version} (it would have "
                                  f"written opset {', '.join(map(str, written))}); nothing was written: choose another "
                                  "--opset or leave it out")
        program.save(staging, external_data=False)  # one file: protobuf's 2 GB limit (a ~500M-parameter fp32 model)
    return path


@torch.no_grad()
def check_onnx(path: str, model: nn.Module, shapes=CHECK_SHAPES, seed: int = 0) -> dict[tuple[int, int], float]:
    """Run the ONNX file with onnxruntime and `model` with PyTorch on random ids of each (batch, length) in `shapes`
    (the first row left-padded by a third of its length where batch > 1); returns the largest absolute logit
    difference over the non-padding positions, per shape."""
    try:
        import onnxruntime
    except ImportError:
        raise ConversionError("checking an ONNX file needs onnxruntime: pip install onnxruntime==1.32.0") from None
    session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    generator = torch.Generator().manual_seed(seed)
    model.eval()
    differences = {}
    for batch, length in shapes:
        ids = torch.randint(0, model.config.vocab_size, (batch, length), generator=generator)
        mask = torch.ones_like(ids)
        if batch > 1:
            mask[0, : length // 3] = 0
        expected = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        got = session.run(["logits"], {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})[0]
        differences[(batch, length)] = (torch.from_numpy(got) - expected)[mask.bool()].abs().max().item()
    return differences


__all__ = ["CHECK_SHAPES", "MIN_OPSET", "LogitsOnly", "check_onnx", "export_program", "supported_opsets", "to_onnx"]
