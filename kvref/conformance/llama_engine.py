"""The llama-cpp-python adapter, in process, on its C API (llama_cpp's ctypes bindings).

The high-level `Llama` object runs one sequence; the suite needs several, so this drives one
llama_context with n_seq_max sequences directly:

    sequence              a seq id of the context, with its next position
    forward               llama_decode of a batch whose tokens all ask for logits (llama_get_logits_ith)
    batch                 one llama_batch holding several seq ids
    fork                  llama_memory_seq_cp(src, dst, -1, -1) into a free seq id
    rollback              llama_memory_seq_rm(seq, n, -1) (it may refuse: returns false)
    context shift         llama_memory_seq_rm(seq, keep, keep + n) + llama_memory_seq_add(seq, keep + n, -1, -n),
                          where llama_memory_can_shift says the cache can
    save / restore        llama_state_get_data / llama_state_set_data of the whole context (what
                          Llama.save_state / load_state use); last_rows reads llama_get_logits_ith(-1)
                          after the restore: whether the state brought back the logits to select from

Options as llama.cpp's defaults except: the K/V cache type is its default float16; swa_full=False (the
window cache llama.cpp keeps for sliding-window layers, not the full-size one llama-cpp-python asks for),
so the sliding-window check reaches the code that is at risk; kv_unified=True so seq_cp shares cells.
"""

from __future__ import annotations

import ctypes

import numpy as np

from .engine import ConformanceError, Engine, Refused, Rows

N_SEQ_MAX = 8
N_BATCH = 512


class Sequence:
    def __init__(self, seq_id: int):
        self.id = seq_id
        self.n_past = 0


class LlamaCppEngine(Engine):
    name = "llama-cpp-python"
    precision = "quantized"

    def __init__(self, path, vocab_size: int, max_positions: int, threads: int | None = None,
                 swa_full: bool = False, flash_attn: bool | None = None):
        try:
            import llama_cpp
        except ImportError:
            raise ConformanceError("llama-cpp-python is not installed in this Python (docs/benchmarks.md: "
                                   "it is built in a venv of its own; run kvref from there)") from None
        self.ll = llama_cpp
        llama_cpp.llama_backend_init()
        llama_cpp.llama_log_set(_quiet, ctypes.c_void_p(0))
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), llama_cpp.llama_model_default_params())
        if not self.model:
            raise ConformanceError(f"llama.cpp could not load {path}")
        n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        if n_vocab != vocab_size:
            raise ConformanceError(f"llama.cpp reads {n_vocab} tokens from {path}; the spec has {vocab_size}")
        self.n_vocab = n_vocab
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = N_SEQ_MAX * max_positions
        params.n_batch = params.n_ubatch = N_BATCH
        params.n_seq_max = N_SEQ_MAX
        params.kv_unified = True
        params.swa_full = swa_full
        if flash_attn is not None:
            params.flash_attn_type = 1 if flash_attn else 0
        if threads is not None:
            params.n_threads = params.n_threads_batch = threads
        self.params = params
        self.ctx = llama_cpp.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise ConformanceError("llama.cpp could not create a context")
        self.memory = llama_cpp.llama_get_memory(self.ctx)
        self.batch = llama_cpp.llama_batch_init(N_BATCH, 0, N_SEQ_MAX)
        self.free_ids = list(range(N_SEQ_MAX))
        self.n_swa = llama_cpp.llama_model_n_swa(self.model)
        caps = {"incremental", "full_logits", "batch", "save_restore", "fork", "rollback", "sliding_window"}
        if llama_cpp.llama_memory_can_shift(self.memory):
            caps.add("context_shift")
        self.capabilities = frozenset(caps)

    def describe(self) -> dict:
        p = self.params
        return {"engine": f"llama-cpp-python {self.ll.__version__}", "n_ctx": p.n_ctx, "n_seq_max": p.n_seq_max,
                "type_k/type_v": f"{p.type_k}/{p.type_v} (1 = f16)", "flash_attn_type": p.flash_attn_type,
                "swa_full": p.swa_full, "n_swa": self.n_swa, "kv_unified": p.kv_unified}

    # ---- sequences ---------------------------------------------------------------------------------

    def new_sequence(self):
        if not self.free_ids:
            raise Refused(f"all {N_SEQ_MAX} sequences of the context are in use")
        seq = Sequence(self.free_ids.pop(0))
        self.ll.llama_memory_seq_rm(self.memory, seq.id, -1, -1)
        return seq

    def free(self, seq) -> None:
        self.ll.llama_memory_seq_rm(self.memory, seq.id, -1, -1)
        if seq.id not in self.free_ids:
            self.free_ids.append(seq.id)

    def close(self) -> None:
        if self.ctx:
            self.ll.llama_batch_free(self.batch)
            self.ll.llama_free(self.ctx)
            self.ll.llama_model_free(self.model)
            self.ctx = None

    def forward(self, seq, ids, last_only=False) -> Rows:
        return self.forward_batch([seq], [ids], last_only)[0]

    def forward_batch(self, seqs, id_lists, last_only=False) -> list:
        """All sequences' new tokens in llama_decode calls of at most N_BATCH tokens (one call when they fit)."""
        items = [(b, seq, i, int(t)) for b, (seq, ids) in enumerate(zip(seqs, id_lists)) for i, t in enumerate(ids)]
        rows = [[] for _ in seqs]
        for start in range(0, len(items), N_BATCH):
            chunk = items[start:start + N_BATCH]
            self._fill(chunk, last_only, [len(ids) for ids in id_lists])
            if self.ll.llama_decode(self.ctx, self.batch) != 0:
                raise Refused("llama_decode failed (no room in the cache for this batch)")
            for j, (b, seq, i, _) in enumerate(chunk):
                if self.batch.logits[j]:
                    rows[b].append(self._logits(j))
        for seq, ids in zip(seqs, id_lists):
            seq.n_past += len(ids)
        return [Rows.from_logits(np.stack(r)) for r in rows]

    def _fill(self, chunk, last_only, lengths):
        batch = self.batch
        batch.n_tokens = len(chunk)
        for j, (b, seq, i, token) in enumerate(chunk):
            batch.token[j] = token
            batch.pos[j] = seq.n_past + i
            batch.n_seq_id[j] = 1
            batch.seq_id[j][0] = seq.id
            batch.logits[j] = (not last_only) or i == lengths[b] - 1

    def _logits(self, j) -> np.ndarray:
        pointer = self.ll.llama_get_logits_ith(self.ctx, j)
        return np.ctypeslib.as_array(pointer, shape=(self.n_vocab,)).astype(np.float64)

    # ---- cache operations ---------------------------------------------------------------------------

    def fork(self, seq):
        child = self.new_sequence()
        self.ll.llama_memory_seq_cp(self.memory, seq.id, child.id, -1, -1)
        child.n_past = seq.n_past
        return child

    def rollback(self, seq, n: int) -> None:
        if not self.ll.llama_memory_seq_rm(self.memory, seq.id, n, -1):
            raise Refused(f"llama_memory_seq_rm(seq, {n}, -1) returned false: the cache cannot remove "
                          f"positions {n}..{seq.n_past - 1}" + (f" (a window cache, n_swa {self.n_swa})"
                                                                  if self.n_swa else ""))
        seq.n_past = n

    def shift(self, seq, n: int, keep: int) -> None:
        if not self.ll.llama_memory_seq_rm(self.memory, seq.id, keep, keep + n):
            raise Refused(f"llama_memory_seq_rm(seq, {keep}, {keep + n}) returned false")
        self.ll.llama_memory_seq_add(self.memory, seq.id, keep + n, -1, -n)
        seq.n_past -= n

    def save(self, seq):
        size = self.ll.llama_state_get_size(self.ctx)
        buffer = (ctypes.c_uint8 * size)()
        written = self.ll.llama_state_get_data(self.ctx, buffer, size)
        return seq.id, seq.n_past, bytes(buffer[:written])

    def restore(self, state):
        seq_id, n_past, data = state
        buffer = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        if self.ll.llama_state_set_data(self.ctx, buffer, len(data)) != len(data):
            raise Refused("llama_state_set_data did not read the whole state")
        if seq_id in self.free_ids:
            self.free_ids.remove(seq_id)
        seq = Sequence(seq_id)
        seq.n_past = n_past
        return seq

    def last_rows(self, seq):
        pointer = self.ll.llama_get_logits_ith(self.ctx, -1)
        if not pointer:
            return None
        return Rows.from_logits(np.ctypeslib.as_array(pointer, shape=(self.n_vocab,)).astype(np.float64))


def _log_callback(level, text, user_data):
    pass


def _make_quiet():
    try:
        import llama_cpp
    except ImportError:
        return None
    return llama_cpp.llama_log_callback(_log_callback)


_quiet = _make_quiet()
