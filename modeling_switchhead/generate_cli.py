"""`switchhead generate DIR --prompt TEXT`: sample from a saved model (any AutoModelForCausalLM folder)."""

from __future__ import annotations

import os


def register(subparsers) -> None:
    parser = subparsers.add_parser("generate", help="generate text from a saved model folder")
    parser.add_argument("model", help="a save_pretrained folder (with its tokenizer)")
    parser.add_argument("--prompt", default="The", help="text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=40)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 means greedy decoding")
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(handler=run)


def run(args) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .cli import UsageError

    if not os.path.isdir(args.model):
        raise UsageError(f"model folder {args.model!r} does not exist")
    if args.max_new_tokens < 1:
        raise UsageError("--max-new-tokens must be >= 1")
    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model).eval()
    inputs = tokenizer(args.prompt, return_tensors="pt")
    sampling = dict(do_sample=True, temperature=args.temperature) if args.temperature > 0 else dict(do_sample=False)
    output = model.generate(**inputs, max_new_tokens=args.max_new_tokens, pad_token_id=tokenizer.pad_token_id
                            or tokenizer.eos_token_id or 0, **sampling)
    print(tokenizer.decode(output[0], skip_special_tokens=True))
    return 0
