"""The transformers adapter: a float32 checkpoint directory run in process with a DynamicCache.

    sequence        a DynamicCache(config=...) (window layers get DynamicSlidingWindowLayer), its length,
                    and the logits of its last position (transformers keeps none: the adapter does)
    forward         model(input_ids, past_key_values=cache), eager attention
    fork            copy.deepcopy of the sequence
    rollback        DynamicCache.crop(n - length) (refused where transformers refuses it: a window layer
                    past its window, unless activate_past_recording() was called)
    save / restore  torch.save / torch.load of the sequence (cache tensors and last logits) through bytes

    batch           left-padded rows of one DynamicCache, attention_mask and position_ids: fresh sequences,
                    then further steps of the same rows (a batched sequence runs only in its batch)

transformers has no prefix cache and no context shift; those checks are skipped.
"""

from __future__ import annotations

import copy
import io

from .engine import ConformanceError, Engine, Refused, Rows


class Sequence:
    def __init__(self, cache):
        self.cache = cache
        self.n_past = 0
        self.last = None  # [V] logits of the last position run
        self.group = None  # the Group whose cache holds this sequence, once it ran in a batch
        self.row = None


class Group:
    """Sequences batched together: one cache of left-padded rows (transformers' convention for batches,
    which keeps the distance between a row's own positions, so sliding windows stay right), and the
    attention mask over its columns (0 = padding)."""

    def __init__(self, cache, mask):
        self.cache = cache
        self.mask = mask  # [B][columns] 0/1


class HFEngine(Engine):
    name = "transformers"

    def __init__(self, directory, max_positions: int = 256):
        try:
            import torch
            import transformers
        except ImportError:
            raise ConformanceError("the transformers engine needs torch and transformers (the test extra)") from None
        self.torch, self.transformers = torch, transformers
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            str(directory), dtype=torch.float32, attn_implementation="eager").eval()
        self.max_positions = max_positions
        self.capabilities = frozenset({"incremental", "full_logits", "batch", "save_restore", "fork", "rollback",
                                       "sliding_window"})

    def describe(self) -> dict:
        return {"engine": f"transformers {self.transformers.__version__}", "torch": self.torch.__version__,
                "cache": "DynamicCache(config=...)", "attention": "eager", "dtype": "float32",
                "batch": "left-padded rows of one cache, attention_mask, position_ids"}

    def new_sequence(self):
        return Sequence(self.transformers.DynamicCache(config=self.model.config))

    def forward(self, seq, ids, last_only=False) -> Rows:
        if seq.group is not None:
            raise Refused("this sequence lives in a batch's padded cache; it runs only in that batch")
        torch = self.torch
        with torch.no_grad():
            out = self.model(input_ids=torch.tensor([list(ids)]), cache=seq.cache, use_cache=True)
        logits = out.logits[0].double().numpy()  # [T, V]
        seq.n_past += len(ids)
        seq.last = logits[-1]
        return Rows.from_logits(logits[-1:] if last_only else logits)

    def forward_batch(self, seqs, id_lists, last_only=False) -> list:
        """Fresh sequences (left-padded to the longest), or the rows of one earlier batch in their order
        with the same number of new tokens each."""
        torch = self.torch
        group = seqs[0].group
        if all(s.n_past == 0 and s.group is None for s in seqs):
            width = max(len(ids) for ids in id_lists)
            mask = [[0] * (width - len(ids)) + [1] * len(ids) for ids in id_lists]
            tokens = [[0] * (width - len(ids)) + list(ids) for ids in id_lists]  # pads: any id, masked
            positions = [[0] * (width - len(ids)) + list(range(len(ids))) for ids in id_lists]
            group = Group(self.transformers.DynamicCache(config=self.model.config), [])
        elif group is not None and all(s.group is group and s.row == b for b, s in enumerate(seqs)) \
                and len({len(ids) for ids in id_lists}) == 1:
            mask = [[1] * len(ids) for ids in id_lists]
            tokens = [list(ids) for ids in id_lists]
            positions = [list(range(s.n_past, s.n_past + len(ids))) for s, ids in zip(seqs, id_lists)]
        else:
            raise Refused("transformers batches fresh sequences, or the rows of one earlier batch in order with "
                          "as many new tokens each")
        group.mask = [old + new for old, new in zip(group.mask or [[] for _ in seqs], mask)]
        with torch.no_grad():
            out = self.model(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(group.mask),
                             position_ids=torch.tensor(positions), cache=group.cache, use_cache=True)
        rows = []
        for b, (seq, ids) in enumerate(zip(seqs, id_lists)):
            logits = out.logits[b, -len(ids):].double().numpy()  # [T_b, V]: the row's own new positions
            seq.group, seq.row, seq.n_past, seq.last = group, b, seq.n_past + len(ids), logits[-1]
            rows.append(Rows.from_logits(logits[-1:] if last_only else logits))
        return rows

    def fork(self, seq):
        return copy.deepcopy(seq)

    def rollback(self, seq, n: int) -> None:
        try:  # transformers 5 crops by a negative count: the positions to remove
            if n < seq.n_past:
                seq.cache.crop(n - seq.n_past)
        except (ValueError, RuntimeError, NotImplementedError, AttributeError) as exc:
            raise Refused(f"DynamicCache.crop({n - seq.n_past}) (back to {n} positions) refused: {exc}") from None
        if seq.cache.get_seq_length() != n:
            raise Refused(f"DynamicCache.crop back to {n} positions left {seq.cache.get_seq_length()}")
        seq.n_past, seq.last = n, None

    def save(self, seq):
        buffer = io.BytesIO()
        self.torch.save(seq, buffer)
        return buffer.getvalue()

    def restore(self, state):
        return self.torch.load(io.BytesIO(state), weights_only=False)

    def last_rows(self, seq):
        return None if seq.last is None else Rows.from_logits(seq.last)
