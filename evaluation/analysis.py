"""Analysis plots in the style of the paper's analysis section, as PNG files (matplotlib, Agg backend).

* Attention maps: for every layer, the maximum over heads, and one panel per head (`output_attentions` with the
  eager backend, which is the one that returns attention probabilities).
* Expert selections: for every layer and every router (value selection W_S, output selection W_D, and the
  sigma-MoE router of SwitchAll), the gate of each selected expert per token, 0 where not selected. Router logits
  come from `output_router_logits`: `[tokens, groups * experts]`, recorded per block in the order value, output,
  then the sigma-MoE router.

Every PNG is exactly `size` pixels (width, height), written by `switchhead.integrity.atomic_file`: never through a
link, never over a device, and over an existing file only with `overwrite` (all names are checked before the
first plot is drawn, so a refused folder gets no file at all).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..integrity import atomic_file
from ..integrity.files import check_target

DEFAULT_SIZE = (1000, 800)
DPI = 100


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _token_labels(tokenizer, ids: list[int]) -> list[str]:
    return [tokenizer.decode([i]).replace("\n", "\\n") for i in ids]


@torch.no_grad()
def run_for_analysis(model, tokenizer, text: str, max_tokens: int = 64):
    """One eager forward over the first `max_tokens` tokens of `text` with attentions and router logits."""
    ids = tokenizer(text, add_special_tokens=False).input_ids[:max_tokens]
    if len(ids) < 2:
        raise ValueError("the text must have at least 2 tokens to plot")
    if getattr(model.config, "_attn_implementation", "eager") != "eager":
        model.set_attn_implementation("eager")  # only eager returns the attention probabilities
    model.eval()
    output_router_logits = getattr(model.config, "attention_type", None) == "switchhead" or \
        getattr(model.config, "mlp_type", None) == "sigma_moe"
    outputs = model(input_ids=torch.tensor([ids], device=next(model.parameters()).device), output_attentions=True,
                    output_router_logits=output_router_logits)
    return ids, outputs


def _save(fig, path: Path, size: tuple[int, int], overwrite: bool = True) -> Path:
    try:
        fig.set_size_inches(size[0] / DPI, size[1] / DPI)
        with atomic_file(str(path), overwrite) as temporary:
            fig.savefig(temporary, dpi=DPI, format="png")  # no bbox_inches="tight": the file is exactly `size` pixels
    finally:
        _pyplot().close(fig)
    return path


def plot_names(config) -> list[str]:
    """The files `analyse` writes for a model of `config`, in order."""
    names = [f"attention_layer{layer}_{kind}.png" for layer in range(config.num_hidden_layers)
             for kind in ("max", "heads")]
    if router_layout(config):
        names += [f"experts_layer{layer}.png" for layer in range(config.num_hidden_layers)]
    return names


def plot_attention_maps(ids, attentions, tokenizer, out_dir: str | Path, size=DEFAULT_SIZE,
                        overwrite: bool = True) -> list[Path]:
    """attentions: per layer `[1, H, T, T]`. Writes attention_layer{L}_max.png and attention_layer{L}_heads.png."""
    plt = _pyplot()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    labels = _token_labels(tokenizer, ids)
    ticks = range(len(labels))
    written = []
    for layer, probs in enumerate(attentions):
        probs = probs[0].float().cpu()  # [H, T, T]
        fig, ax = plt.subplots()
        image = ax.imshow(probs.max(0).values.numpy(), cmap="viridis", vmin=0, vmax=1)
        ax.set_title(f"layer {layer}: attention, max over {probs.shape[0]} heads")
        ax.set_xticks(ticks, labels, rotation=90, fontsize=6)
        ax.set_yticks(ticks, labels, fontsize=6)
        ax.set_xlabel("key (attended to)")
        ax.set_ylabel("query")
        fig.colorbar(image, ax=ax)
        written.append(_save(fig, out_dir / f"attention_layer{layer}_max.png", size, overwrite))

        heads = probs.shape[0]
        fig, axes = plt.subplots(1, heads, squeeze=False)
        for head, ax in enumerate(axes[0]):
            ax.imshow(probs[head].numpy(), cmap="viridis", vmin=0, vmax=1)
            ax.set_title(f"head {head}", fontsize=8)
            ax.set_xticks(ticks, labels, rotation=90, fontsize=4)
            ax.set_yticks(ticks, labels if head == 0 else [""] * len(labels), fontsize=4)
        fig.suptitle(f"layer {layer}: attention per head")
        written.append(_save(fig, out_dir / f"attention_layer{layer}_heads.png", size, overwrite))
    return written


def selected_gates(logits: torch.Tensor, groups: int, top_k: int) -> torch.Tensor:
    """Router logits `[T, G*E]` -> `[T, G*E]` sigmoid gate of each top-k expert per group, 0 elsewhere."""
    scores = torch.sigmoid(logits.float()).view(logits.shape[0], groups, -1)
    keep = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, scores.topk(top_k, dim=-1).indices, True)
    return (scores * keep).flatten(1)


def router_layout(config) -> list[tuple[str, int, int]]:
    """(name, groups, top_k) of each router of one block, in the order the model records them."""
    routers = []
    if config.attention_type == "switchhead":
        names = {"value": "value selection (W_S)", "output": "output selection (W_D)"}
        for side in getattr(config, "attention_expert_routers", ("value", "output")):
            routers.append((names[side], config.num_attention_heads, config.num_attention_experts_per_tok))
    if config.mlp_type == "sigma_moe":
        routers.append(("sigma-MoE MLP", 1, config.num_mlp_experts_per_tok))
    return routers


def plot_expert_selections(ids, router_logits, config, tokenizer, out_dir: str | Path,
                           size=DEFAULT_SIZE, overwrite: bool = True) -> list[Path]:
    """Writes experts_layer{L}.png: one heat map per router of the block, tokens x experts (grouped by head)."""
    layout = router_layout(config)
    if not layout:
        raise ValueError("this model has no expert routers (dense attention and dense MLP): nothing to plot")
    if len(router_logits) != len(layout) * config.num_hidden_layers:
        raise ValueError(f"expected {len(layout)} routers per layer x {config.num_hidden_layers} layers, "
                         f"got {len(router_logits)} router outputs")
    plt = _pyplot()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    labels = _token_labels(tokenizer, ids)
    written = []
    for layer in range(config.num_hidden_layers):
        fig, axes = plt.subplots(1, len(layout), squeeze=False)
        for (name, groups, top_k), ax, logits in zip(layout, axes[0],
                                                     router_logits[layer * len(layout):(layer + 1) * len(layout)]):
            gates = selected_gates(logits[-len(ids):].cpu(), groups, top_k)
            ax.imshow(gates.numpy(), cmap="magma", vmin=0, vmax=1, aspect="auto", interpolation="nearest")
            experts = gates.shape[1] // groups
            for boundary in range(1, groups):  # separate the heads' experts
                ax.axvline(boundary * experts - 0.5, color="white", linewidth=1)
            ax.set_title(name, fontsize=8)
            ax.set_xlabel("head x expert" if groups > 1 else "expert", fontsize=7)
            ax.set_yticks(range(len(labels)), labels if ax is axes[0][0] else [""] * len(labels), fontsize=5)
        fig.suptitle(f"layer {layer}: gates of the selected experts per token")
        written.append(_save(fig, out_dir / f"experts_layer{layer}.png", size, overwrite))
    return written


def analyse(model, tokenizer, text: str, out_dir: str | Path, size=DEFAULT_SIZE, max_tokens: int = 64,
            overwrite: bool = False) -> list[Path]:
    """All plots for `text`: attention maps for every layer, and expert selections when the model has routers.
    Every file name is checked first: an existing file (without `overwrite`), a link or a device at any of them
    refuses the whole set (`switchhead.integrity.OutputError`) before anything is written."""
    for name in plot_names(model.config):
        check_target(str(Path(out_dir) / name), overwrite)
    ids, outputs = run_for_analysis(model, tokenizer, text, max_tokens)
    written = plot_attention_maps(ids, outputs.attentions, tokenizer, out_dir, size, overwrite)
    if router_layout(model.config):
        written += plot_expert_selections(ids, outputs.router_logits, model.config, tokenizer, out_dir, size,
                                          overwrite)
    return written
