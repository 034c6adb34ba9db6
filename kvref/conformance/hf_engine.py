"""The transformers adapter: a float32 checkpoint directory run in process with a DynamicCache.

    sequence        a DynamicCache(config=...) (window layers get DynamicSlidingWindowLayer), its length,
                    and the logits of its last position (transformers keeps none: the adapter does)
    forward         model(input_ids, past_key_values=cache), eager attention
    fork            copy.deepcopy of the sequence
    rollback        DynamicCache.crop(n - length) (refused where transformers refuses it: a window layer
                    past its window, unless activate_past_recording() was called)
    save / restore  torch.save / torch.load of the sequence (cache tensors and last logits) through bytes

transformers has no prefix cache, no context shift, and batches only padded sequences of one
cache object; the adapter declares none of those, so those checks are skipped.
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
        self.capabilities = frozenset({"incremental", "full_logits", "save_restore", "fork", "rollback",
                                       "sliding_window"})

    def describe(self) -> dict:
        return {"engine": f"transformers {self.transformers.__version__}", "torch": self.torch.__version__,
                "cache": "DynamicCache(config=...)", "attention": "eager", "dtype": "float32"}

    def new_sequence(self):
        return Sequence(self.transformers.DynamicCache(config=self.model.config))

    def forward(self, seq, ids, last_only=False) -> Rows:
        torch = self.torch
        with torch.no_grad():
            out = self.model(input_ids=torch.tensor([list(ids)]), cache=seq.cache, use_cache=True)
        logits = out.logits[0].double().numpy()  # [T, V]
        seq.n_past += len(ids)
        seq.last = logits[-1]
        return Rows.from_logits(logits[-1:] if last_only else logits)

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
