"""The figures of docs/: regenerated from kvref's own formulas and from measured JSON.

    pip install -e ".[bench]"             # matplotlib, for benchmarks only; kvref never imports it
    python benchmarks/plots.py [--out docs/figures] [--measured benchmarks/data]

  cost-per-execution.png   FLOPs of each execution of a generation with and without the KV cache
                           (kvref.trace's count, SmolLM2-135M's architecture): the recomputation
                           grows with the history, the cached decode step stays flat
  cache-bytes.png          KV cache bytes against context length for each layout and K/V type
                           (kvref.cache.report's formulas), SmolLM2-135M and Gemma 3 270M
  decode-vs-context.png    decode tok/s against cached positions, kvref beside llama.cpp, from the
                           JSON files `benchmarks/compare.py --cases context --context N --json
                           decode_vs_context_N.json` wrote into --measured (one per N); left out
                           when there are none
  by-model-size.png        kvref's C forward beside llama.cpp by model size and weight type, 2 threads:
                           decode and 512-token prefill as ratios to llama.cpp's tok/s, and the
                           decode's fraction of the roofline, from the JSON files `benchmarks/compare.py
                           --engines kvref-c kvref-c-int8 llama.cpp --cases decode prefill --json` wrote
                           into --measured/by-size (docs/benchmarks.md has the commands); left out when
                           there are none
  layers.png               kvref's units in the layers tests/test_layering.py declares, lowest at the
                           bottom, with the number of import statements from each layer to each one
                           below it (read from the source, as the test reads it)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.lines  # noqa: E402
import matplotlib.patches  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402
import numpy as np  # noqa: E402

from compare import roofline_fractions  # noqa: E402  (benchmarks/, this script's folder)
from kvref import trace  # noqa: E402
from kvref.cache import bytes_per_position, cache_bytes  # noqa: E402
from kvref.cache.hybrid import positions_held  # noqa: E402
from kvref.loader import load_config  # noqa: E402

HERE = Path(__file__).resolve().parent
MiB = 2**20


def cost_per_execution(out: Path, prompt: int = 32, steps: int = 96):
    config = load_config("smollm2")
    rows = {"without a cache (recompute the history)": [], "with the KV cache (new position only)": []}
    for step in range(steps):
        end = prompt + step + 1
        first_new = end - 1 if step else 0
        rows["without a cache (recompute the history)"].append(trace.execution(config, first_new, end, 0))
        rows["with the KV cache (new position only)"].append(trace.execution(config, first_new, end, end - 1 if step else 0))
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, executions in rows.items():
        ax.plot(range(steps), [(e.projection_flops + e.attention_flops) / 1e9 for e in executions], label=label)
    ax.set(xlabel=f"execution (0: the {prompt}-token prompt, then one per generated token)", ylabel="GFLOPs",
           title="SmolLM2-135M: work per execution")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "cost-per-execution.png", dpi=110)
    plt.close(fig)


def cache_bytes_by_layout(out: Path):
    lengths = [2**k for k in range(8, 16)]  # 256 .. 32K positions
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, name in zip(axes, ("smollm2", "gemma3-270m")):
        c = load_config(name)
        for dtype in ("float32", "float16"):
            ax.plot(lengths, [cache_bytes(c.n_layers, n, c.n_kv_heads, c.head_dim, dtype) / MiB for n in lengths],
                    label=f"contiguous {dtype}")
        int8 = bytes_per_position(c.n_layers, c.n_kv_heads, c.head_dim, "int8")
        ax.plot(lengths, [n * int8 / MiB for n in lengths], label="contiguous int8 (scales included)")
        if c.layer_windows is not None:
            per_row = bytes_per_position(1, c.n_kv_heads, c.head_dim, "float16")  # one layer's K and V
            ax.plot(lengths, [sum(positions_held(c.layer_windows, n)) * per_row / MiB for n in lengths],
                    label="hybrid float16 (window layers keep 576)", linewidth=2.5)
        ax.set(xscale="log", yscale="log", xlabel="positions", ylabel="MiB per sequence",
               title=f"{name}: {c.n_layers} layers x {c.n_kv_heads} kv heads x {c.head_dim}")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(out / "cache-bytes.png", dpi=110)
    plt.close(fig)


def decode_vs_context(out: Path, measured: Path) -> bool:
    points = {}
    for path in sorted(measured.glob("decode_vs_context_*.json")):
        data = json.loads(path.read_text())
        context = data["settings"]["context"]
        for row in data["medians"]:
            if row["case"] == "context" and row["threads"] == 2:
                points.setdefault(row["engine"], []).append((context, row["tok_s"]))
    if not points:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    for engine, values in sorted(points.items()):
        if len(values) < 2:
            continue  # an engine measured at one length only (compare.py's default run) draws no line
        values.sort()
        ax.plot([c for c, _ in values], [v for _, v in values], marker="o", label=engine)
    model = Path(data["settings"]["model"] or "SmolLM2-135M-Instruct").name
    ax.set(xscale="log", xlabel="cached positions", ylabel="decode tok/s (2 threads, median of 3 rounds)",
           title=f"{model}: decode speed against context")
    ax.set_ylim(bottom=0)
    ax.set_xticks(sorted({c for values in points.values() for c, _ in values}))
    ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.legend()
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(out / "decode-vs-context.png", dpi=110)
    plt.close(fig)
    return True


# the engines of the by-model-size figure, as compare.py names them, and how they are drawn
SIZE_ENGINES = {"kvref-c-int8": ("kvref, default (int8 activations)", "o", "full"),
                "kvref-c": ("kvref --exact (float32 activations)", "o", "none"),
                "llama.cpp": ("llama.cpp", "s", "full")}
SIZE_TYPE_COLORS = {"Q4_0": "tab:blue", "Q4_1": "tab:cyan", "Q4_K_M": "tab:orange", "Q6_K": "tab:green",
                    "Q8_0": "tab:red"}


def by_model_size(out: Path, measured: Path) -> bool:
    runs = {}  # (model, weight type) -> compare.py's JSON, file names compare_<model>-<weight type>.json
    for path in sorted((measured / "by-size").glob("compare_*.json")):
        data = json.loads(path.read_text())
        if data["probes"]:  # else a run whose workers all failed
            model, wtype = path.stem.removeprefix("compare_").rsplit("-", 1)
            runs[model, wtype] = data
    if not runs:
        return False
    smallest = {}
    for (model, _), data in runs.items():
        smallest[model] = min(smallest.get(model, 1e30), data["probes"][0]["weight_bytes"])
    models = sorted(smallest, key=smallest.get)  # by size: each model a slot on the x axis, its types side by side
    types = list(SIZE_TYPE_COLORS)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.8))
    panels = [(axes[0], "decode", "decode tok/s / llama.cpp's", {"default": 1.5, "--exact": 1.0}),
              (axes[1], "prefill", "prefill 512 tok/s / llama.cpp's", {"default": 2.5})]
    for (model, wtype), data in runs.items():
        x = models.index(model) + 0.16 * (types.index(wtype) - (len(types) - 1) / 2)
        color = SIZE_TYPE_COLORS[wtype]
        rate = {(m["case"], m["engine"]): m["tok_s"] for m in data["medians"] if m["threads"] == 2 and m["tok_s"]}
        for ax, case, _, _ in panels:
            for engine, (_, marker, fill) in SIZE_ENGINES.items():
                if engine != "llama.cpp" and (case, engine) in rate and (case, "llama.cpp") in rate:
                    ax.plot(x, rate[case, engine] / rate[case, "llama.cpp"], marker=marker, fillstyle=fill,
                            color=color, markersize=8, linestyle="none")
        for engine, (_, marker, fill) in SIZE_ENGINES.items():
            fractions = roofline_fractions(data["runs"], data["probes"], engine, 2, "decode")
            if fractions:
                axes[2].plot(x, 100 * float(np.median(fractions)), marker=marker, fillstyle=fill, color=color,
                             markersize=8, linestyle="none")
    for ax, case, ylabel, targets in panels:
        for label, y in targets.items():
            ax.axhline(y, color="0.5", linestyle="--", linewidth=1)
            ax.annotate(f"target, {label}", (0, y), xycoords=("axes fraction", "data"), ha="left", va="bottom",
                        fontsize=8, color="0.4")
        ax.axhline(1.0, color="0.2", linewidth=0.8)
        ax.set(ylabel=ylabel, title=f"{case}, 2 threads (medians of 3 rounds)")
    axes[2].axhline(80, color="0.5", linestyle="--", linewidth=1)
    axes[2].annotate("target", (0, 80), xycoords=("axes fraction", "data"), ha="left", va="bottom", fontsize=8,
                     color="0.4")
    axes[2].set(ylabel="% of the roofline (rate x the file's bytes / probe)",
                title="decode against the read probe, 2 threads")
    for ax in axes:
        ax.set_xticks(range(len(models)), [m.replace("-", "\n", 1) for m in models], fontsize=8)
        ax.set_xlim(-0.5, len(models) - 0.5)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3, axis="y")
    handles = [matplotlib.lines.Line2D([], [], color="0.3", marker=m, fillstyle=f, linestyle="none", label=label)
               for label, m, f in SIZE_ENGINES.values()]
    handles += [matplotlib.patches.Patch(color=c, label=t) for t, c in SIZE_TYPE_COLORS.items()]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(out / "by-model-size.png", dpi=110)
    plt.close(fig)
    return True

def layers(out: Path):
    import sys

    sys.path.insert(0, str(HERE.parent))  # tests/ is not installed: read the declared order from the repo
    from tests.test_layering import LAYERS, LAYER, unit_imports

    fig, ax = plt.subplots(figsize=(11, 0.62 * len(LAYERS) + 0.6))
    for i, names in enumerate(LAYERS):
        label = "  ".join(sorted(n or "kvref (the public API)" for n in names))
        ax.add_patch(matplotlib.patches.FancyBboxPatch((0.02, i + 0.12), 0.74, 0.76, boxstyle="round,pad=0.01",
                                                       facecolor=plt.cm.Blues(0.15 + 0.06 * i), edgecolor="0.4"))
        ax.text(0.04, i + 0.5, f"{i}", va="center", fontsize=10, weight="bold")
        ax.text(0.08, i + 0.5, label, va="center", fontsize=9)
    counts = {}
    for a, b, name, _ in unit_imports():
        if a in LAYER and b in LAYER and LAYER[a] != LAYER[b] and name != "__version__":  # as the test reads them
            counts[LAYER[a], LAYER[b]] = counts.get((LAYER[a], LAYER[b]), 0) + 1
    for i in range(len(LAYERS)):
        below = sorted((j, n) for (a, j), n in counts.items() if a == i)
        if below:
            ax.text(0.78, i + 0.5, "imports from " + ", ".join(f"{j} ({n})" for j, n in below), va="center",
                    fontsize=7.5, color="0.3")
    ax.set_xlim(0, 1.2)
    ax.set_ylim(0, len(LAYERS))
    ax.axis("off")
    ax.set_title("kvref's layers (tests/test_layering.py): a unit imports only from its own layer and those below",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "layers.png", dpi=110)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=HERE.parent / "docs" / "figures")
    parser.add_argument("--measured", type=Path, default=HERE / "data")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    cost_per_execution(args.out)
    cache_bytes_by_layout(args.out)
    layers(args.out)
    made = [decode_vs_context(args.out, args.measured), by_model_size(args.out, args.measured)]
    print(f"wrote figures to {args.out}" + ("" if all(made) else f" (some measured JSON missing in {args.measured})"))


if __name__ == "__main__":
    main()
