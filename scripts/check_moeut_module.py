"""`switchhead convert moeut-to-hf` against the authors' MoEUT module itself: a `MoEUTLM` from a checkout of
RobertCsordas/moeut, its state dict converted and converted back, the logits of both models compared.

    git clone https://github.com/RobertCsordas/moeut ../moeut
    python scripts/check_moeut_module.py ../moeut                         # a tiny model, and MoEUT_126M
    python scripts/check_moeut_module.py ../moeut --profiles MoEUT_1B --device cuda

On CUDA their module runs as published (its Triton CVMM kernel). Elsewhere their `moeut/cvmm.py`, which needs
Triton and a GPU, is not loaded: `cvmm` and `cvmm_prepare_sel2` come from a plain PyTorch equivalent written here
from what the kernel computes (each (token, slot) pair, sorted by expert, multiplies its input row by that expert's
matrix into its output row; then, with reduction weights, a weighted sum over the last selection axis). Nothing of
their code is copied; it is imported from the checkout given.

Prints, per model, the largest |logit difference| (fp32) and whether the state dict came back bit-exactly; exits 1
if a difference exceeds 1e-5 or a tensor differs.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import types
from dataclasses import dataclass

import torch

TINY = dict(n_tokens=97, d_model=32, n_layers=6, n_heads=2, ff_n_experts=6, att_n_experts=3, d_head=8,
            group_size=3, ff_k=2, att_k=2, ff_expert_size=16)


@dataclass
class _Selection:
    """The selection record their module hands to `cvmm` (the fields it reads and rewrites)."""

    raw_sel: torch.Tensor
    sel: torch.Tensor
    sel_index: torch.Tensor
    out_index: torch.Tensor | None = None
    reduction_weight: torch.Tensor | None = None

    def clone(self) -> "_Selection":
        return _Selection(self.raw_sel, self.sel, self.sel_index, self.out_index, self.reduction_weight)


def _prepare(selected: torch.Tensor, weights: torch.Tensor | None = None) -> _Selection:
    """Sort the chosen experts; remember each slot's input row (its token) and its place in the output."""
    per_row = selected.shape[-1]
    experts, slots = selected.flatten().sort()
    return _Selection(selected, experts.view_as(selected), slots // per_row, slots, weights)


def _cvmm(x: torch.Tensor, selection: _Selection, matrices: torch.Tensor) -> torch.Tensor:
    rows = x.flatten(end_dim=-2)
    inputs = selection.sel_index.long()
    outputs = inputs if selection.out_index is None else selection.out_index.long()
    experts = selection.sel.flatten().long()
    result = rows.new_zeros(experts.numel(), matrices.shape[-1])
    result[outputs] = torch.bmm(rows[inputs].unsqueeze(1), matrices[experts]).squeeze(1)
    result = result.view(*selection.sel.shape, matrices.shape[-1])
    if selection.reduction_weight is not None:
        weights = selection.reduction_weight
        result = (weights.unsqueeze(-2).type_as(result) @ result.view(*weights.shape, -1)).squeeze(-2)
    return result


def load_authors_module(checkout: str, device: str) -> types.ModuleType:
    """Their `moeut/moeut.py` as a module; off CUDA with the PyTorch CVMM above in place of their Triton one."""
    folder = os.path.join(checkout, "moeut")
    if not os.path.isfile(os.path.join(folder, "moeut.py")):
        raise SystemExit(f"{checkout} is not a checkout of RobertCsordas/moeut (no moeut/moeut.py)")
    package = types.ModuleType("moeut")
    package.__path__ = [folder]
    sys.modules["moeut"] = package
    if device != "cuda":
        sys.modules["moeut.cvmm"] = types.SimpleNamespace(cvmm=_cvmm, cvmm_prepare_sel2=_prepare, CVMMSel=_Selection)
    spec = importlib.util.spec_from_file_location("moeut.moeut", os.path.join(folder, "moeut.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules["moeut.moeut"] = module
    spec.loader.exec_module(module)
    return module


def check(authors, args: dict, name: str, device: str, tokens: int, folder: str) -> bool:
    from switchhead import SwitchHeadForCausalLM
    from switchhead.conversion import ConversionError, convert_moeut_checkpoint, export_moeut_checkpoint

    torch.manual_seed(0)
    theirs = authors.MoEUTLM(**args).to(device).eval()
    with torch.no_grad():  # layer norms and biases away from their initial 1 and 0, so that a swap would show
        for parameter_name, parameter in theirs.named_parameters():
            if parameter.dim() == 1:
                parameter.add_(0.1 * torch.randn_like(parameter))
    state_file, folder_out, back = (os.path.join(folder, f"{name}{suffix}") for suffix in (".pt", "", "-back.pt"))
    torch.save({key: value.cpu() for key, value in theirs.state_dict().items()}, state_file)
    ids = torch.randint(0, args["n_tokens"], (2, tokens), generator=torch.Generator().manual_seed(1)).to(device)
    try:
        convert_moeut_checkpoint(state_file, folder_out, moeut_args=args)
    except ConversionError as refusal:  # right only if their module cannot run the model either
        try:
            with torch.no_grad():
                theirs(ids)
        except Exception as failure:  # noqa: BLE001 - whatever their forward raises
            print(f"{name}: refused ({refusal}); their forward fails too ({type(failure).__name__}: {failure})")
            return True
        print(f"{name}: REFUSED although their module runs it: {refusal}")
        return False
    ours = SwitchHeadForCausalLM.from_pretrained(folder_out).to(device).eval()
    with torch.no_grad():
        difference = (theirs(ids).outputs.float() - ours(ids).logits.float()).abs().max().item()
    export_moeut_checkpoint(folder_out, back)
    saved, returned = torch.load(state_file, weights_only=True), torch.load(back, weights_only=True)
    exact = list(saved) == list(returned) and all(torch.equal(saved[k], returned[k]) for k in saved)
    print(f"{name}: max |logit difference| {difference:.3g} (fp32, {device}, {tokens} tokens); round trip "
          f"{'bit-exact' if exact else 'DIFFERS'}; {sum(p.numel() for p in ours.parameters()):,} parameters")
    return difference <= 1e-5 and exact


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkout", help="a checkout of https://github.com/RobertCsordas/moeut")
    parser.add_argument("--profiles", default="MoEUT_126M",
                        help="comma-separated profiles.py names to check besides the tiny model ('' for none)")
    parser.add_argument("--n-tokens", type=int, default=8000, help="vocabulary of the profile models (8000)")
    parser.add_argument("--tokens", type=int, default=48, help="sequence length of the comparison (48)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    authors = load_authors_module(args.checkout, args.device)
    spec = importlib.util.spec_from_file_location("moeut_profiles", os.path.join(args.checkout, "profiles.py"))
    profiles = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(profiles)
    models = {"tiny": TINY}
    for name in filter(None, args.profiles.split(",")):
        models[name] = {"n_tokens": args.n_tokens, **getattr(profiles, name)}
    ok = True
    with tempfile.TemporaryDirectory() as folder:
        for name, model_args in models.items():
            print(f"{name}: MoEUTLM(**{json.dumps(model_args)})")
            ok = check(authors, model_args, name, args.device, args.tokens, folder) and ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
