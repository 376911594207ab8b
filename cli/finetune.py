"""`switchhead finetune`: LoRA fine-tuning of a saved model with PEFT and the Transformers `Trainer`.

    switchhead finetune runs/wt2 --data ../shared/data/wikitext-2 --output-dir runs/wt2-lora --rank 8
    switchhead finetune runs/wt2 --data my.txt --output-dir out --target-modules q_proj,k_proj \\
        --target-parameters value_experts,output_experts --merge

By default every projection is adapted (`switchhead.training.finetune.lora_targets`): q/k (and XL's position keys),
the dense baseline's v/o, the dense MLP and lm_head through `target_modules`; SwitchHead's value/output experts and
the sigma-MoE expert_keys/expert_values through `target_parameters`. The output folder holds the adapter only (load
it with `switchhead.training.finetune.load_lora` or `PeftModel.from_pretrained`), the tokenizer and
`finetune.json`; `--merge` also writes the merged plain model to OUTPUT/merged.
"""

from __future__ import annotations

import argparse

from .common import UsageError


def _names(value: str) -> list[str]:
    return [name.strip() for name in value.split(",") if name.strip()] if value != "none" else []


def register(subparsers) -> None:
    parser = subparsers.add_parser("finetune", help="LoRA fine-tuning of a saved model (PEFT + Trainer)",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="save_pretrained folder with its tokenizer (e.g. a `switchhead train` run)")
    parser.add_argument("--data", required=True, help="a .txt/.tokens/.jsonl file or a folder (as `train --data`)")
    parser.add_argument("--output-dir", required=True, help="new folder for the adapter")
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank r (8)")
    parser.add_argument("--alpha", type=float, default=None, help="LoRA alpha (default 2 * rank)")
    parser.add_argument("--target-modules", type=_names, default=None,
                        help="comma-separated module names, or 'none' (default: every dense projection)")
    parser.add_argument("--target-parameters", type=_names, default=None,
                        help="comma-separated expert tensor names, or 'none' (default: every expert tensor)")
    parser.add_argument("--max-steps", type=int, default=100, help="optimizer steps (100)")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per step (8)")
    parser.add_argument("--block-size", type=int, default=None, help="tokens per sequence (default min(256, "
                                                                      "max_position_embeddings))")
    parser.add_argument("--learning-rate", type=float, default=1e-3, help="peak learning rate, cosine decay (1e-3)")
    parser.add_argument("--warmup-steps", type=int, default=0, help="linear warmup steps (0)")
    parser.add_argument("--seed", type=int, default=0,
                        help="random seed of the LoRA initialisation and the data order (0)")
    parser.add_argument("--merge", action="store_true", help="also write the merged model to OUTPUT/merged")
    parser.add_argument("--no-verify", action="store_true",
                        help="fine-tune a training run's folder even when its SHA-256 manifest does not verify")
    parser.add_argument("--quantize", choices=["bnb-int8", "bnb-nf4", "torchao-int8"], default=None,
                        help="load the base quantised (dense projections only; expert tensors stay in full "
                             "precision) and train LoRA on top: bnb-nf4 is QLoRA (needs the [quant] extra)")
    parser.add_argument("--report-to", default="none", metavar="TRACKERS",
                        help="Trainer's report_to: tensorboard (into OUTPUT/tensorboard), wandb, mlflow, a comma list "
                             "of them, all (those installed) or none (the default, as Transformers')")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(handler=run)


def run(args) -> int:
    from switchhead.training.data import DataError
    from switchhead.training.finetune import FinetuneDiverged, FinetuneError, finetune

    try:
        result = finetune(args.model, args.data, args.output_dir, r=args.rank, lora_alpha=args.alpha,
                          target_modules=args.target_modules, target_parameters=args.target_parameters,
                          max_steps=args.max_steps, batch_size=args.batch_size, block_size=args.block_size,
                          learning_rate=args.learning_rate, warmup_steps=args.warmup_steps, seed=args.seed,
                          merge=args.merge, quantize=args.quantize, verify=not args.no_verify,
                          report_to=args.report_to, progress=not args.no_progress)
    except (FinetuneError, DataError) as error:
        raise UsageError(str(error)) from None
    except FinetuneDiverged as error:  # as `switchhead train` on divergence
        raise UsageError(str(error), exit_code=3) from None
    print(f"{result.steps} steps, {result.trainable_parameters:,} of {result.total_parameters:,} parameters trained: "
          f"validation perplexity {result.valid_perplexity_before:.2f} -> {result.valid_perplexity_after:.2f}; "
          f"adapter in {result.output_dir}")
    return 0
