"""What each layout costs, from the formulas alone: the rows `kvref memory` prints.

    bytes per position = n_layers x n_kv_heads x (K bytes + V bytes) per head vector
    K or V bytes       = head_dim x element bytes  (+ head_dim / group_size x 4 for int8 scales)

For float K/V that is the articles' 2 x layers x kv heads x head_dim x bytes. A paged sequence
occupies whole blocks (its last block may be part empty); a window holds at most sinks + window
positions whatever the length.
"""

from __future__ import annotations

from .contiguous import ContiguousCache
from .hybrid import DEFAULT_SPARE, positions_held
from .paged import PagedCache
from .pool import DEFAULT_BLOCK_SIZE, blocks_for
from .quant import ELEMENT_BYTES, SCALE_DTYPE, Codec, Codecs, default_group_size
from .shape import CacheShape
from .window import WindowCache

DTYPE_PAIRS = (("float32", "float32"), ("float16", "float16"), ("bfloat16", "bfloat16"),
               ("int8", "int8"), ("float16", "int8"))


def layout_rows(config, tokens: int | None = None, batch: int = 1, block_size: int = DEFAULT_BLOCK_SIZE,
                window: int | None = None, sinks: int = 4, group_size: int | None = None) -> list[dict]:
    """One dict per (layout, K dtype, V dtype): bytes per position, the formula, bytes at `tokens` x `batch`.

    tokens defaults to the model's max_seq_len; window to min(1024, tokens).
    """
    tokens = config.max_seq_len if tokens is None else int(tokens)
    window = min(1024, tokens) if window is None else int(window)
    L, Hkv, D = config.n_layers, config.n_kv_heads, config.head_dim
    shape = CacheShape(L, Hkv, D, config.max_seq_len)
    g = default_group_size(D) if group_size is None else group_size
    rows = []
    for k, v in DTYPE_PAIRS:
        kc, vc = Codec(k, D, g), Codec(v, D, g)
        formula = f"{L} x {Hkv} x ({_vector(kc)} + {_vector(vc)})"
        if k == v and not kc.has_scales:
            formula = f"2 x {L} x {Hkv} x {D} x {ELEMENT_BYTES[k]}"
        held = {  # label: (layout, positions held)
            "contiguous": (ContiguousCache, tokens),
            f"paged (block {block_size})": (PagedCache, blocks_for(tokens, block_size) * block_size),
            f"window (W={window}, sinks {sinks})": (WindowCache, min(tokens, window + sinks)),
        }
        for layout, (cls, positions) in held.items():
            if cls is WindowCache and (k, v) not in (("float16", "float16"), ("int8", "int8")):
                continue  # the window's saving is in positions, not element types: two rows suffice
            per_position = cls.position_bytes(shape, Codecs(kc, vc))  # what the layout declares
            rows.append({"layout": layout, "k_dtype": kc.describe(), "v_dtype": vc.describe(),
                         "bytes_per_position": per_position, "formula": formula, "tokens": tokens,
                         "positions_held": positions, "bytes_per_sequence": positions * per_position,
                         "batch": batch, "bytes_total": positions * per_position * batch})
    return rows


def layout_report(config, tokens: int | None = None, batch: int = 1, **options) -> str:
    """A table of layout_rows for printing (`kvref memory`)."""
    rows = layout_rows(config, tokens, batch, **options)
    head = (f"{'layout':<26} {'K':<9} {'V':<9} {'bytes/position':>14}  {'formula':<34} "
            f"{'positions held':>14} {'per sequence':>12} {'x ' + str(batch):>12}")
    lines = [f"KV cache for {config.n_layers} layers x {config.n_kv_heads} kv heads x head_dim {config.head_dim}, "
             f"{rows[0]['tokens']:,} tokens per sequence, batch {batch}", head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['layout']:<26} {r['k_dtype']:<9} {r['v_dtype']:<9} {r['bytes_per_position']:>14,}  "
                     f"{r['formula']:<34} {r['positions_held']:>14,} {_human(r['bytes_per_sequence']):>12} "
                     f"{_human(r['bytes_total']):>12}")
    return "\n".join(lines)


def window_summary(config) -> str:
    """Which layers attend over a sliding window and which over everything, in one line."""
    windows = config.layer_windows or (None,) * config.n_layers
    groups = {}
    for layer, w in enumerate(windows):
        groups.setdefault(w, []).append(layer)
    parts = [f"{'global' if w is None else f'window {w}'} on {_ranges(layers)}" for w, layers in groups.items()]
    return f"{config.n_layers} layers: " + "; ".join(parts)


def hybrid_report(config, tokens: int, dtype: str, batch: int = 1, spare: int = DEFAULT_SPARE) -> str:
    """What the hybrid cache (the default for a model with window layers) holds at `tokens` positions."""
    held = positions_held(config.layer_windows, tokens, spare)
    per_row = config.n_kv_heads * 2 * Codec(dtype, config.head_dim).bytes_per_vector()
    hybrid, full = sum(held) * per_row * batch, config.n_layers * tokens * per_row * batch
    rings = sorted({h for h, w in zip(held, config.layer_windows) if w is not None and h < tokens})
    return (f"hybrid cache (the default for this model): {window_summary(config)}\n"
            f"  window layers keep rings of {', '.join(map(str, rings)) or 'all'} positions (window + spare "
            f"{spare}), global layers all {tokens:,}: {sum(held):,} layer-positions instead of "
            f"{config.n_layers * tokens:,}\n"
            f"= {hybrid:,} bytes ({_human(hybrid)}), {full / hybrid:.2f}x less than a full cache ({_human(full)})")


def _ranges(layers) -> str:
    # [0, 1, 2, 4] -> "0-2, 4"
    runs, start = [], layers[0]
    for prev, layer in zip(layers, layers[1:] + [None]):
        if layer != prev + 1:
            runs.append(f"{start}-{prev}" if prev > start else f"{start}")
            start = layer
    return ", ".join(runs)


def _vector(codec) -> str:
    text = f"{codec.head_dim} x {ELEMENT_BYTES[codec.name]}"
    if codec.has_scales:
        text = f"({text} + {codec.n_groups} x {SCALE_DTYPE.itemsize})"
    return text


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"
