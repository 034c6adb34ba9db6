"""How a cache describes where its K/V lie, for code that reads and writes them in place (kvref.native)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .quant import SlotStore


@dataclass(frozen=True)
class Storage:
    """Where a cache's K/V lie, for code that reads and writes them in place (kvref.native).

    store        the SlotStore: k, v [L, *slots, Hkv, D] in their stored forms, int8 scales
                 [L, *slots, Hkv, D/g]; store.k_codec / v_codec name the element types and group size
    block_table  int64 [n_blocks]: position p lives in slot (block_table[p // block_size],
                 p % block_size) of slots (num_blocks, block_size); None: position p lives in slot p
    block_size   positions per block (1 without a block table)
    layer_rings  None, or one int per layer: 0 = the layer's position p lives in its slot p (through
                 the block table when there is one); R > 0 = the layer is a ring of R slots,
                 position p in its slot p % R. With rings, block_table is None and the store's arrays
                 are [1, sum of the layers' extents, Hkv, D] (scales likewise): layer l's slots follow
                 layer l-1's; a layer's extent is its R, or layer_slots for a layer without a ring
    layer_slots  slots of each layer without a ring (with layer_rings; else unused)
    k_residual   kivi4 K: float16 [L, g, Hkv, D], the K of positions past the last full group (position
                 p in row p % g; KiviResidual.rows, or an execution's staged copy); else None
    """

    store: SlotStore
    block_table: np.ndarray | None = None
    block_size: int = 1
    layer_rings: tuple | None = None
    layer_slots: int = 0
    k_residual: np.ndarray | None = None
