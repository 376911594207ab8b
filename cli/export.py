"""`switchhead export`: a saved model as an ONNX file with a dynamic batch and sequence length.

    switchhead export runs/wt2 wt2.onnx            # inputs input_ids, attention_mask [batch, sequence] -> logits
    switchhead export runs/wt2 wt2.onnx --check    # then onnxruntime against PyTorch at several shapes

The graph is one forward without a KV cache (`switchhead.conversion.export`: what is and is not exported). It needs
onnx and onnxscript (and onnxruntime for --check), which the test extra pins.
"""

from __future__ import annotations

import argparse
import os

from .common import UsageError, refuse_existing_output


def register(subparsers) -> None:
    parser = subparsers.add_parser("export", help="export a saved model to ONNX (dynamic batch and sequence)",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="save_pretrained folder of a causal LM (or a task model with logits)")
    parser.add_argument("output", help="the .onnx file to write")
    parser.add_argument("--opset", type=int, default=None, help="ONNX opset version (default: the exporter's)")
    parser.add_argument("--check", action="store_true",
                        help="run the file with onnxruntime and report the largest logit difference to PyTorch")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing output file (only once the new one is complete)")
    parser.add_argument("--no-verify", action="store_true",
                        help="export a training run's folder even when its SHA-256 manifest does not verify")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="run the folder's own Python files (an auto_map); without it such a folder is refused")
    parser.set_defaults(handler=run)


# the saved class -> the Auto class that loads it (the models whose output has `logits`)
AUTO_CLASSES = {"SwitchHeadForCausalLM": "AutoModelForCausalLM",
                "SwitchHeadForSequenceClassification": "AutoModelForSequenceClassification",
                "SwitchHeadForTokenClassification": "AutoModelForTokenClassification"}


def run(args) -> int:
    import torch
    import transformers

    from switchhead.conversion import ConversionError
    from switchhead.conversion.export import check_onnx, supported_opsets, to_onnx
    from switchhead.integrity import check_remote_code, check_saved_model

    if not os.path.isfile(os.path.join(args.model, "config.json")):
        raise UsageError(f"{args.model} is not a saved model folder (it has no config.json)")
    refuse_existing_output(args.output, args.overwrite, model=args.model)  # never a file of the model read
    try:
        opsets = supported_opsets()
    except ConversionError as error:
        raise UsageError(str(error)) from None
    if args.opset is not None and args.opset not in opsets:  # the exporter would write another one and say nothing
        raise UsageError(f"--opset {args.opset} is not one this exporter can write; choose {opsets.start} to "
                         f"{opsets.stop - 1}, or leave it out")
    trust = check_remote_code(args.model, args.trust_remote_code)  # before config.json is read: it may name code
    config = transformers.AutoConfig.from_pretrained(args.model, trust_remote_code=trust)
    if config.model_type != "switchhead":
        raise UsageError(f"{args.model} holds a {config.model_type!r} model; this command exports SwitchHead models")
    architecture = (config.architectures or ["SwitchHeadForCausalLM"])[0]
    if architecture not in AUTO_CLASSES:
        raise UsageError(f"{architecture} has no logits to export; export a causal LM or a sequence / token "
                         f"classifier")
    auto_class = getattr(transformers, AUTO_CLASSES[architecture])
    check_saved_model(args.model, verify=not args.no_verify, trust_remote_code=trust)
    model = auto_class.from_pretrained(args.model, dtype=torch.float32, trust_remote_code=trust).eval()
    try:  # an existing file is replaced by the rename that ends the export, never removed before it
        to_onnx(model, args.output, opset_version=args.opset, overwrite=args.overwrite)
        print(f"wrote {args.output} ({os.path.getsize(args.output) / 2**20:.1f} MiB): inputs input_ids, "
              f"attention_mask [batch, sequence], output logits")
        if args.check:
            differences = check_onnx(args.output, model)
            print("onnxruntime against PyTorch, largest logit difference: "
                  + ", ".join(f"{batch}x{length}: {value:.2e}" for (batch, length), value in differences.items()))
            worst = max(differences.values())
            if not worst <= 1e-4:
                raise UsageError(f"the ONNX file's logits differ from PyTorch's by {worst:.2e} (more than 1e-4)")
    except ConversionError as error:
        raise UsageError(str(error)) from None
    return 0
