"""`switchhead generate DIR --prompt TEXT`: sample from a saved model (any AutoModelForCausalLM folder)."""

from __future__ import annotations

import math
import os

from .common import UsageError


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "generate", help="generate text from a saved model folder",
        description="Continue a prompt with a saved model folder (any AutoModelForCausalLM folder with its "
                    "tokenizer, e.g. a `switchhead train` run): greedy decoding by default, sampling with "
                    "--temperature > 0; the text is printed to stdout.")
    parser.add_argument("model", help="a save_pretrained folder (with its tokenizer)")
    parser.add_argument("--prompt", default="The", help="text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=40, help="tokens to generate after the prompt (40)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 means greedy decoding")
    parser.add_argument("--seed", type=int, default=0, help="random seed of the sampling (--temperature > 0)")
    parser.add_argument("--no-verify", action="store_true",
                        help="load a training run's folder even when its SHA-256 manifest does not verify")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="run the folder's own Python files (an auto_map in its config or tokenizer config); "
                             "without it such a folder is refused")
    parser.set_defaults(handler=run)


def run(args) -> int:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from switchhead.integrity import check_saved_model

    if not os.path.exists(args.model):
        raise UsageError(f"model folder {args.model!r} does not exist")
    if not os.path.isdir(args.model):
        raise UsageError(f"model {args.model!r} is a file; give a save_pretrained folder")
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        raise UsageError(f"model folder {args.model!r} has no config.json; give a save_pretrained folder")
    if args.max_new_tokens < 1:
        raise UsageError("--max-new-tokens must be >= 1")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise UsageError(f"--temperature must be >= 0 (0: greedy decoding), got {args.temperature}")
    from switchhead.serving.requests import MIN_SAMPLING_TEMPERATURE  # below it the float32 logits divide by 0

    if 0 < args.temperature < MIN_SAMPLING_TEMPERATURE:
        raise UsageError(f"--temperature must be 0 (greedy) or at least {MIN_SAMPLING_TEMPERATURE:g} (sampling), got "
                         f"{args.temperature}")
    if not 0 <= args.seed < 2**63:
        raise UsageError(f"--seed must be an integer in [0, 2**63), got {args.seed}")
    if not args.prompt:
        raise UsageError("--prompt is empty; give some text to continue")
    # --no-verify skips the manifest, not the rest: pickled or missing weights, sizes past this machine's memory,
    # weights that do not fit config.json, NaN weights; code from the folder only with --trust-remote-code
    trust = check_saved_model(args.model, verify=not args.no_verify, trust_remote_code=args.trust_remote_code)
    from switchhead.integrity.loading import check_decoding_method

    check_decoding_method(args.model)
    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.model, trust_remote_code=trust)
    inputs = tokenizer(args.prompt, return_tensors="pt")
    prompt_tokens = inputs["input_ids"].shape[-1]
    if prompt_tokens == 0:
        raise UsageError(f"--prompt {args.prompt!r} gives no tokens with this tokenizer; give some text")
    context = getattr(AutoConfig.from_pretrained(args.model, trust_remote_code=trust),
                      "max_position_embeddings", None)
    if context is not None and prompt_tokens + args.max_new_tokens > context:
        room = context - prompt_tokens
        raise UsageError(f"--max-new-tokens {args.max_new_tokens}: the prompt has {prompt_tokens} tokens and the model "
                         f"reads at most {context} (max_position_embeddings), "
                         + (f"so at most {room} new ones" if room > 0 else "so shorten the prompt"))
    model = AutoModelForCausalLM.from_pretrained(args.model, trust_remote_code=trust).eval()
    sampling = dict(do_sample=True, temperature=args.temperature) if args.temperature > 0 else dict(do_sample=False)
    output = model.generate(**inputs, max_new_tokens=args.max_new_tokens, pad_token_id=tokenizer.pad_token_id
                            or tokenizer.eos_token_id or 0, **sampling)
    print(tokenizer.decode(output[0], skip_special_tokens=True))
    return 0
