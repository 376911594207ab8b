"""Regenerates docs/assets/speed_ratios.png (the Performance page's picture) from the whole-model benchmark's JSON
results in benchmarks/results: SwitchHead / dense ratios against the context length, one panel for decoding
tokens/s (prompt 128 and 1024), one for training step time (context 256 and 512) and prefill time.

    python docs/_scripts/speed_ratios.py
"""

import json
from pathlib import Path

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"
FULL = "model_full_cpu_intel-r--xeon-r--processor_1t.json"
DECODE = {128: "model_decode_cpu_intel-r--xeon-r--processor_1t.json",
          1024: "model_decode_p1024_cpu_intel-r--xeon-r--processor_1t.json"}
FAMILIES = {"rope": ("RoPE", "tab:blue"), "xl": ("XL", "tab:orange")}


def ratios(name: str) -> dict:
    return json.loads((RESULTS / name).read_text(encoding="utf-8"))["ratios"]


def main() -> None:
    fig, (decode, train) = plt.subplots(1, 2, figsize=(11, 4))
    prompts = sorted(DECODE)
    for family, (label, color) in FAMILIES.items():
        for batch, style in ((1, "-"), (8, "--")):
            for mode, marker in (("eager", "o"), ("compiled", "s")):
                key = f"decode_tok_s_{mode}@b{batch}"
                decode.plot(prompts, [ratios(DECODE[p])[family][key] for p in prompts], style, marker=marker,
                            color=color, alpha=1.0 if mode == "eager" else 0.55,
                            label=f"{label}, batch {batch}, {mode}")
        full = ratios(FULL)[family]
        train.plot([256, 512], [full["train_time@256"], full["train_time@512"]], "-o", color=color,
                   label=f"{label}: training step time")
        train.plot(prompts, [ratios(DECODE[p])[family]["prefill_time"] for p in prompts], "--^", color=color,
                   label=f"{label}: prefill time (batch 1)")
    decode.axhline(1.0, color="grey", linewidth=0.8)
    train.axhline(1.0, color="grey", linewidth=0.8)
    decode.set(title="decoding tokens/s, SwitchHead / dense (higher: SwitchHead faster)", xlabel="prompt tokens",
               ylabel="ratio", xscale="log", xticks=prompts, xticklabels=[str(p) for p in prompts])
    train.set(title="time, SwitchHead / dense (lower: SwitchHead faster)", xlabel="context tokens", ylabel="ratio",
              xscale="log", xticks=[128, 256, 512, 1024], xticklabels=["128", "256", "512", "1024"])
    for ax in (decode, train):
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())  # only the measured lengths on the log axis
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        ax.title.set_fontsize(9)
    fig.suptitle("47M SwitchHead vs parameter-matched dense, CPU, 1 thread (benchmarks/results/model_*.json)",
                 fontsize=10)
    fig.tight_layout()
    out = REPO / "docs" / "assets" / "speed_ratios.png"
    fig.savefig(out, dpi=110)
    print(out)


if __name__ == "__main__":
    main()
