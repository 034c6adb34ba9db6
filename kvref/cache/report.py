"""What each layout costs, from the formulas alone: the rows `kvref memory` prints.

    bytes per position = n_layers x n_kv_heads x (K bytes + V bytes) per head vector
    K or V bytes       = head_dim x element bytes  (+ head_dim / group_size x 4 for int8 scales)

For float K/V that is the articles' 2 x layers x kv heads x head_dim x bytes. A paged sequence
occupies whole blocks (its last block may be part empty); a window holds at most sinks + window
positions whatever the length.
"""

from __future__ import annotations

from .hybrid import DEFAULT_SPARE, positions_held
from .pool import DEFAULT_BLOCK_SIZE, blocks_for
from .quant import ELEMENT_BYTES, GROUPED_DTYPES, SCALE_DTYPE, Codec, Codecs, default_group_size, kv_codecs
from .registry import layout_class
from .shape import CacheShape

# every K/V type, and float16 K beside int8 V (K is the more sensitive half)
DTYPE_PAIRS = (("float32", "float32"), ("float16", "float16"), ("bfloat16", "bfloat16"),
               ("int8", "int8"), ("kivi4", "kivi4"), ("float16", "int8"))


def layout_rows(config, tokens: int | None = None, batch: int = 1, block_size: int = DEFAULT_BLOCK_SIZE,
                window: int | None = None, sinks: int = 4, group_size: int | None = None,
                spare: int = DEFAULT_SPARE) -> list[dict]:
    """One dict per (layout, K dtype, V dtype) a cache can store: bytes per position, the formula,
    positions held, bytes at `tokens` x `batch`. The layouts: contiguous, paged, window, and hybrid for
    a config with window layers; a K type that quantizes groups of positions (kivi4) only where a group
    is never split (contiguous; paged with blocks a multiple of the group).

    tokens defaults to the model's max_seq_len; window to min(1024, tokens).
    """
    tokens = config.max_seq_len if tokens is None else int(tokens)
    window = min(1024, tokens) if window is None else int(window)
    L = config.n_layers
    Hkv, D, _, latent = config.cache_geometry()  # MLA: one latent key of R + Dr values, no V
    shape = CacheShape(L, Hkv, D, config.max_seq_len, latent_dim=latent)
    g = default_group_size(D) if group_size is None and latent is None else group_size
    rows = []
    for k, v in DTYPE_PAIRS:
        if latent is not None and (k != v or k == "kivi4"):
            continue  # a latent cache stores one key type and no V; kivi4 it refuses (quant.kv_codecs)
        kc, vc = kv_codecs(k, v, D, g if _grouped(k, v) else None, latent)
        formula = f"{L} x {Hkv} x ({_vector(kc)} + {_vector(vc)})"
        if latent is not None:
            formula = f"{L} x {_vector(kc)}"
        elif k == v and not kc.has_scales:
            formula = f"2 x {L} x {Hkv} x {D} x {ELEMENT_BYTES[k]}"
        block = -(-block_size // g) * g if kc.groups_positions else block_size  # a K group within a block
        held = {  # layout -> positions each layer holds
            "contiguous": [tokens] * L,
            f"paged (block {block})": [blocks_for(tokens, block) * block] * L,
            f"window (W={window}, sinks {sinks})": [min(tokens, window + sinks)] * L,
        }
        if config.layer_windows is not None:
            held[f"hybrid (spare {spare})"] = positions_held(config.layer_windows, tokens, spare)
        for layout, positions in held.items():
            cls = layout_class(layout.split()[0])
            if kc.groups_positions and not cls.keeps_groups:
                continue  # a ring would overwrite part of a K group: the layout refuses this type
            per_position = cls.position_bytes(shape, Codecs(kc, vc))  # what the layout declares
            per_row = per_position // L  # one position of one layer
            rows.append({"layout": layout, "k_dtype": kc.describe(), "v_dtype": vc.describe(),
                         "bytes_per_position": per_position, "formula": formula, "tokens": tokens,
                         "positions_held": max(positions), "positions_per_layer": tuple(positions),
                         "bytes_per_sequence": sum(positions) * per_row, "batch": batch,
                         "bytes_total": sum(positions) * per_row * batch})
    return rows


def layout_report(config, tokens: int | None = None, batch: int = 1, **options) -> str:
    """A table of layout_rows for printing (`kvref memory`), each column as wide as its widest cell."""
    rows = layout_rows(config, tokens, batch, **options)
    header = ("layout", "K", "V", "bytes/position", "formula", "positions held", "per sequence", f"x {batch}")
    right = (False, False, False, True, False, True, True, True)  # numbers right-aligned
    cells = [header] + [(r["layout"], r["k_dtype"], r["v_dtype"], f"{r['bytes_per_position']:,}", r["formula"],
                         _held(r), _human(r["bytes_per_sequence"]), _human(r["bytes_total"])) for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(w) if r else cell.ljust(w) for cell, w, r in zip(row, widths, right)).rstrip()
             for row in cells]
    lines.insert(1, "-" * len(lines[0]))
    what = (f"a latent key of kv_lora_rank {config.kv_lora_rank} + qk_rope_head_dim {config.qk_rope_head_dim} "
            "(MLA: no V)" if config.latent else f"{config.n_kv_heads} kv heads x head_dim {config.head_dim}")
    title = f"KV cache for {config.n_layers} layers x {what}, {rows[0]['tokens']:,} tokens per sequence, batch {batch}"
    notes = []
    if any(min(r["positions_per_layer"]) != r["positions_held"] for r in rows):
        notes.append("hybrid: positions held by the window layers' rings / by the global layers")
    if any(Codec(k, config.head_dim).groups_positions for k, _ in DTYPE_PAIRS):
        notes.append("kivi4 K quantizes groups of positions, which a ring (window, hybrid) would split: "
                     "those layouts store kivi4 for V only")
    return "\n".join([title, *lines, *notes])


def _grouped(k, v) -> bool:
    """Whether K or V of the pair takes a group size (int8, kivi4)."""
    return bool({k, v} & set(GROUPED_DTYPES))


def _held(row) -> str:
    """Positions each layer holds: one number, or (hybrid) the window layers' rings / the global layers'."""
    fewest, most = min(row["positions_per_layer"]), row["positions_held"]
    return f"{most:,}" if fewest == most else f"{fewest:,} / {most:,}"


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
        pair = " x 2" if codec.scale_width == 2 else ""  # kivi4: a (scale, zero) pair per group
        text = f"({text} + {codec.n_groups}{pair} x {SCALE_DTYPE.itemsize})"
    return text


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"
