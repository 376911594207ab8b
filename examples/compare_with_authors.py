"""The drop-in layers against the authors' own modules: initialisation under one seed, outputs and gradients with
their state dict loaded strictly, dropout under one RNG stream, and cached decoding against each module's own full
forward.

    python examples/compare_with_authors.py --switchhead PATH/switchhead
    python examples/compare_with_authors.py --moe-layer PATH/moe_layer/triton_src

PATH/switchhead is a checkout of RobertCsordas/switchhead (its `switchhead/` package), PATH/moe_layer one of
RobertCsordas/moe_layer (its `triton_src/moe_layer/` package). Without a GPU their Triton kernels run in Triton's
interpreter (set here), one autotuning configuration each, and their `.cuda()` calls stay on the CPU. One package a
run: both register the same torch op (`mylib::cvmm_triton`).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "0" if "--gpu" in sys.argv else "1")

import torch  # noqa: E402


def _import_as(folder: str, package: str, alias: str):
    """Import `folder/package` under the name `alias` (theirs is also called `switchhead`)."""
    spec = importlib.util.spec_from_file_location(alias, os.path.join(folder, package, "__init__.py"),
                                                  submodule_search_locations=[os.path.join(folder, package)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[alias] = module
    spec.loader.exec_module(module)
    return module


def _cpu_friendly_triton() -> None:
    """Triton's interpreter has no benchmarker: autotuning takes each kernel's first configuration."""
    import triton

    def first_configuration(configs, key, **_):
        return triton.heuristics({name: (lambda _args, value=value: value) for name, value in configs[0].kwargs.items()})

    triton.autotune = first_configuration
    if not torch.cuda.is_available():
        torch.Tensor.cuda = lambda self, *args, **kwargs: self


def _difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def compare_attention(theirs_package, name: str, experts: int) -> dict:
    import switchhead

    arguments = {"d_head": 8, "moe_k": 2 if experts > 1 else 1, "init_scale": 0.8}
    torch.manual_seed(0)
    theirs = getattr(theirs_package, name)(32, 4, experts, **arguments)
    torch.manual_seed(0)
    ours = getattr(switchhead, name)(32, 4, experts, **arguments)
    # their XL leaves pos_to_pk uninitialised: compare the rest, then give both the same one
    same_init = all(torch.equal(value, ours.state_dict()[key]) for key, value in theirs.state_dict().items()
                    if key != "pos_to_pk")
    if name == "SwitchHeadXL":
        with torch.no_grad():
            theirs.pos_to_pk.normal_(std=0.2)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    x = torch.randn(2, 6, 32)
    x1, x2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    (a, _), (b, _) = theirs(x1, x1, x1, None), ours(x2, x2, x2, None)
    output = _difference(a.detach(), b.detach())
    weights = torch.randn_like(a)
    (a * weights).sum().backward()
    (b * weights).sum().backward()
    ours_tensors = ours.state_dict(keep_vars=True)
    gradients = max(_difference(p.grad, ours_tensors[key].grad) for key, p in theirs.named_parameters())
    cache_error = {}
    with torch.no_grad():
        for label, module in (("theirs", theirs), ("ours", ours)):
            full, _ = module(x, x, x, None)
            _, cache = module(x[:, :5], x[:, :5], x[:, :5], None, {})
            step, _ = module(x[:, 5:], x[:, 5:], x[:, 5:], None, cache)
            cache_error[label] = _difference(step, full[:, 5:])
    dropout = {}
    for setting in ({"dropout": 0.3}, {"expert_dropout": 0.3}):
        torch.manual_seed(1)
        their_module = getattr(theirs_package, name)(32, 4, experts, **arguments, **setting).train()
        our_module = getattr(switchhead, name)(32, 4, experts, **arguments, **setting).train()
        if name == "SwitchHeadXL":
            with torch.no_grad():
                their_module.pos_to_pk.normal_(std=0.2)
        our_module.load_state_dict(their_module.state_dict())
        torch.manual_seed(2)
        a, _ = their_module(x, x, x, None)
        torch.manual_seed(2)
        b, _ = our_module(x, x, x, None)
        dropout[next(iter(setting))] = _difference(a, b)
    return {"init_equal": same_init, "output": output,
            "input_gradient": _difference(x1.grad, x2.grad), "parameter_gradients": gradients,
            "cached_step_vs_full": cache_error, "dropout_shared_rng": dropout}


def compare_sigma_moe(moe_package) -> dict:
    import switchhead

    torch.manual_seed(0)
    theirs = moe_package.MoE(32, 8, 6, 3, weight_std_scale=0.7)
    torch.manual_seed(0)
    ours = switchhead.SigmaMoE(32, 8, 6, 3, weight_std_scale=0.7)
    same_init = all(torch.equal(value, ours.state_dict()[key]) for key, value in theirs.state_dict().items())
    ours.load_state_dict(theirs.state_dict(), strict=True)
    x = torch.randn(2, 5, 32)
    x1, x2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    (a, their_loss), (b, our_loss) = theirs(x1), ours(x2)
    (a.square().sum() + their_loss).backward()
    (b.square().sum() + our_loss).backward()
    gradients = max(_difference(p.grad, getattr(ours, key).grad) for key, p in theirs.named_parameters())
    return {"init_equal": same_init, "output": _difference(a, b), "reg_loss": abs(their_loss.item() - our_loss.item()),
            "input_gradient": _difference(x1.grad, x2.grad), "parameter_gradients": gradients}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--switchhead", help="a checkout of RobertCsordas/switchhead")
    parser.add_argument("--moe-layer", help="RobertCsordas/moe_layer's triton_src folder")
    parser.add_argument("--gpu", action="store_true", help="run their kernels compiled (needs CUDA)")
    args = parser.parse_args(argv)
    if bool(args.switchhead) == bool(args.moe_layer):
        parser.error("give one of --switchhead and --moe-layer")
    _cpu_friendly_triton()
    results = {}
    if args.switchhead:
        theirs = _import_as(args.switchhead, "switchhead", "authors_switchhead")
        results = {f"{name}(n_experts={experts})": compare_attention(theirs, name, experts)
                   for name in ("SwitchHeadRope", "SwitchHeadXL") for experts in (4, 1)}
    else:
        results["SigmaMoE"] = compare_sigma_moe(_import_as(args.moe_layer, "moe_layer", "authors_moe_layer"))
    for name, found in results.items():
        print(name, found)
    return results


if __name__ == "__main__":
    main()
