"""`kvref perplexity`: how well a model predicts a text, over strided windows as llama-perplexity
does, and how far its next-token distributions are from a saved base run (KL divergence).

    kvref perplexity -f FILE [-m MODEL] [--ctx 512] [--stride CTX/2] [--kv-dtype float32]
                     [--save-logits base.npz | --kl-base base.npz]

The windows (llama-perplexity's --ppl-stride scheme): the text's tokens are cut into windows of ctx
tokens starting at 0, stride, 2 stride, ... (as many as fit whole; tokens after the last are not
scored). Each window runs from an empty cache, and only its last `stride` tokens are scored, each
given every token before it in the window: every scored token has at least ctx - stride tokens of
context, and every token from position ctx - stride up to the end of the last window is scored
exactly once. With --stride ctx - 1 a window scores all its tokens but the first (so one window
over the whole text scores every token after the first). A text shorter than --ctx is scored as one
window over the whole text, which the command says: every token after the first, or with --stride S
its last S. If the tokenizer adds BOS, each window's first token is replaced by BOS, as
llama-perplexity does; it is never scored.

    perplexity = exp(mean over scored tokens of -log p(token | window before it))

reported with the standard error of that estimate (delta method: perplexity x std(NLL) / sqrt(n)).

--save-logits FILE keeps the log-distribution [V] (float32) of every scored token, with the tokens
and windows; --kl-base FILE compares this run to such a file token by token: KL(base || this run)
= sum_v p_base(v) (log p_base(v) - log p(v)), its mean, median and maximum, and how often the most
likely token is the same; both sides are compared as float32, the precision the file keeps, so a run
compared with its own file gives 0 exactly. The base is meant to be a float32 run (the default --kv-dtype), the run
compared a cache type, backend, quantization or engine. The file is large: 4 x V bytes per scored
token (200 KB at V = 49152).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import InputFileError, ScoringError
from ..scoring import SCORE_CHUNK, next_token_logprobs
from .common import activations, add_activations_argument, add_model_arguments, count, plural

LOGITS_FORMAT = "kvref-logprobs-1"  # what a --save-logits file holds; a new layout gets a new name


@dataclass
class Perplexity:
    """The figures of one run: the NLL of every scored token, the time the windows took."""

    nll: np.ndarray  # [n] float64: -log p of each scored token, in text order
    positions_run: int  # positions executed over all windows
    seconds: float

    @property
    def value(self) -> float:
        return float(np.exp(self.nll.mean()))

    @property
    def standard_error(self) -> float:
        n = self.nll.size
        return self.value * float(self.nll.std(ddof=1)) / np.sqrt(n) if n > 1 else float("nan")


def windows(n_tokens: int, ctx: int, stride: int) -> list[int]:
    """The first position of every window that fits the text (see the module docstring)."""
    if isinstance(ctx, bool) or not isinstance(ctx, (int, np.integer)) or ctx < 2:
        raise ScoringError(f"ctx={ctx!r} must be an integer >= 2 (a window needs a token to score after one)")
    if isinstance(stride, bool) or not isinstance(stride, (int, np.integer)) or not 1 <= stride < ctx:
        raise ScoringError(f"stride={stride!r} must be an integer in [1, ctx - 1 = {ctx - 1}] (each window scores "
                           "its last stride tokens after at least one before them)")
    if n_tokens < ctx:
        raise ScoringError(f"the text has {n_tokens} tokens, fewer than one window of ctx={ctx}; give a smaller "
                           "--ctx or a longer text")
    return list(range(0, n_tokens - ctx + 1, stride))


def window_logprobs(model, token_ids, ctx: int, stride: int, bos_id=None, kv_dtype=None,
                    chunk_size: int = SCORE_CHUNK):
    """Yield (first scored position in the text, [stride, V] log-distributions, scored ids) per window."""
    ids = np.asarray(token_ids, dtype=np.int64)
    for start in windows(len(ids), ctx, stride):
        window = ids[start:start + ctx].copy()
        if bos_id is not None:
            window[0] = bos_id
        cache = model.new_cache(capacity=ctx - 1, kv_dtype=kv_dtype)
        rows = np.concatenate([r for _, r in next_token_logprobs(model, window, ctx - stride, cache, chunk_size)])
        yield start + ctx - stride, rows, window[ctx - stride:]


def perplexity(model, token_ids, ctx: int, stride: int, bos_id=None, kv_dtype=None, save=None, base=None,
               chunk_size: int = SCORE_CHUNK):
    """Score a text's tokens over strided windows: (Perplexity, KL statistics or None).

    save: a path to write every scored token's log-distribution to (with the tokens and windows);
    base: such a file, to compare with token by token (KL(base || this run), top-1 agreement).
    """
    base_file = None if base is None else BaseRun(base, token_ids, ctx, stride, bos_id)
    nll, kl, same_top, saved = [], [], [], {}
    begin = time.perf_counter()
    for k, (first, rows, targets) in enumerate(window_logprobs(model, token_ids, ctx, stride, bos_id, kv_dtype,
                                                                chunk_size)):
        nll.append(-rows[np.arange(len(rows)), targets])
        stored = rows.astype(np.float32)  # compared at the precision a saved run keeps: a run equals its own file
        if save is not None:
            saved[f"window{k}"] = stored
        if base_file is not None:
            reference = base_file.rows(k)
            kl.append(kl_divergence(reference, stored))
            same_top.append(reference.argmax(axis=1) == stored.argmax(axis=1))
    seconds = time.perf_counter() - begin
    n_windows = len(nll)
    result = Perplexity(np.concatenate(nll), n_windows * (ctx - 1), seconds)
    if save is not None:
        save_logprobs(save, token_ids, ctx, stride, bos_id, saved)
    stats = None if base_file is None else KLStats(np.concatenate(kl), np.concatenate(same_top), base_file.nll())
    return result, stats


def kl_divergence(reference_logprobs, logprobs) -> np.ndarray:
    """KL(reference || other) per row: sum_v p_ref (log p_ref - log p); [n, V] log-probabilities -> [n]."""
    reference = np.asarray(reference_logprobs, dtype=np.float64)
    return (np.exp(reference) * (reference - np.asarray(logprobs, dtype=np.float64))).sum(axis=1)


@dataclass
class KLStats:
    kl: np.ndarray  # [n] KL(base || this run) of each scored token
    same_top: np.ndarray  # [n] bool: the most likely token agrees
    base_nll: np.ndarray  # [n] the base run's NLL of each scored token


def save_logprobs(path, token_ids, ctx, stride, bos_id, rows_by_window: dict) -> None:
    np.savez(path, format=np.array(LOGITS_FORMAT), token_ids=np.asarray(token_ids, dtype=np.int64),
             ctx=np.int64(ctx), stride=np.int64(stride), bos_id=np.int64(-1 if bos_id is None else bos_id),
             **rows_by_window)


class BaseRun:
    """A --save-logits file, checked to hold the same tokens and windows as the run compared with it."""

    def __init__(self, path, token_ids, ctx, stride, bos_id):
        self.path = Path(path)
        try:
            self.file = np.load(self.path, allow_pickle=False)
            fmt = str(self.file["format"])
            saved = (self.file["token_ids"], int(self.file["ctx"]), int(self.file["stride"]), int(self.file["bos_id"]))
        except (OSError, ValueError, KeyError) as exc:
            raise InputFileError(f"{path} is not a file of saved log-probabilities (kvref perplexity "
                                 f"--save-logits): {exc}") from None
        if fmt != LOGITS_FORMAT:
            raise InputFileError(f"{path} holds {fmt!r}; this kvref reads {LOGITS_FORMAT!r}")
        ids, saved_ctx, saved_stride, saved_bos = saved
        if (saved_ctx, saved_stride) != (ctx, stride):
            raise ScoringError(f"{path} was saved with ctx={saved_ctx}, stride={saved_stride}; this run uses "
                               f"ctx={ctx}, stride={stride}: the scored tokens would differ")
        if not np.array_equal(ids, np.asarray(token_ids)) or saved_bos != (-1 if bos_id is None else bos_id):
            raise ScoringError(f"{path} was saved from other tokens ({ids.size} tokens; this text has "
                               f"{len(token_ids)}): another text or another tokenizer")
        self.token_ids = ids
        self.starts = windows(len(ids), ctx, stride)
        self.ctx, self.stride = ctx, stride

    def rows(self, k: int) -> np.ndarray:
        rows = self.file[f"window{k}"]
        if rows.shape[0] != self.stride:
            raise InputFileError(f"{self.path}: window {k} holds {rows.shape[0]} rows, not stride={self.stride}")
        return rows

    def nll(self) -> np.ndarray:
        scored = [self.token_ids[s + self.ctx - self.stride:s + self.ctx] for s in self.starts]
        return np.concatenate([-self.rows(k)[np.arange(self.stride), t] for k, t in enumerate(scored)])


# ---- the command -----------------------------------------------------------------------------------------

def add_perplexity(commands):
    p = commands.add_parser("perplexity", help="perplexity of a text over strided windows (and KL against a "
                                               "saved base run)",
                            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(p)
    add_activations_argument(p)
    p.add_argument("-f", "--file", required=True, help="the text to score (UTF-8)")
    p.add_argument("--ctx", type=count, default=512, help="tokens per window (default 512)")
    p.add_argument("--stride", type=count, default=None,
                   help="tokens between window starts, and scored per window (default ctx/2; a text shorter "
                        "than --ctx is one window, scored from its second token unless --stride is given)")
    p.add_argument("--kv-dtype", default="float32", choices=["float32", "float16", "bfloat16", "int8"],
                   help="K/V storage of the cache (default float32)")
    p.add_argument("--chunk", type=count, default=SCORE_CHUNK,
                   help=f"positions per execution (default {SCORE_CHUNK}; bounds the logits held at once)")
    runs = p.add_mutually_exclusive_group()
    runs.add_argument("--save-logits", metavar="OUT.npz", help="save every scored token's log-distribution")
    runs.add_argument("--kl-base", metavar="SAVED.npz", help="compare with a run saved by --save-logits")
    p.set_defaults(run=run_perplexity)


def run_perplexity(args) -> int:
    from ..loader import load

    text = read_text(args.file)
    model = load(args.model, backend=args.backend, activations=activations(args))
    tok = model.tokenizer
    if tok is None:
        raise ScoringError(f"{args.model} has no tokenizer to read the text with")
    ids = tok.encode(text, add_special=True)
    bos_id = tok.bos_id if tok.add_bos else None
    ctx, stride = fit_windows(len(ids), args.ctx, args.stride)
    result, stats = perplexity(model, ids, ctx, stride, bos_id, args.kv_dtype, save=args.save_logits,
                               base=args.kl_base, chunk_size=args.chunk)
    n_windows = len(windows(len(ids), ctx, stride))
    shape = (f"one window over the whole text (fewer than --ctx {args.ctx})" if ctx < args.ctx else
             f"{plural(n_windows, 'window')} of {ctx} (stride {stride})")
    print(f"{plural(len(ids), 'token')}, {shape}, {result.nll.size:,} scored "
          f"(each after >= {plural(ctx - stride, 'token')} of context)")
    print(f"perplexity {result.value:.4f} +/- {result.standard_error:.4f}")
    print(f"{result.positions_run:,} positions in {result.seconds:.1f} s: "
          f"{result.positions_run / result.seconds:.1f} tokens/s (backend {model.backend}, K/V {args.kv_dtype})")
    if stats is not None:
        base_ppl = float(np.exp(stats.base_nll.mean()))
        print(f"base perplexity {base_ppl:.4f}; ratio {result.value / base_ppl:.4f}")
        print(f"KL(base || this run): mean {stats.kl.mean():.6f}, median {np.median(stats.kl):.6f}, "
              f"max {stats.kl.max():.6f}; same top token {100 * stats.same_top.mean():.2f}%")
    if args.save_logits:
        print(f"saved the scored log-distributions to {args.save_logits}", file=sys.stderr)
    return 0


def fit_windows(n_tokens: int, ctx: int, stride: int | None) -> tuple[int, int]:
    """(ctx, stride) of the command's windows: --ctx and --stride (default ctx/2) as given, or for a text
    shorter than --ctx one window of the whole text, scoring every token after the first (or the last
    --stride tokens, when given)."""
    if n_tokens >= ctx:
        return ctx, ctx // 2 if stride is None else stride
    if n_tokens < 2:
        raise ScoringError(f"the text has {plural(n_tokens, 'token')}; scoring needs at least 2 (one to score, "
                           "one before it)")
    if stride is not None and stride >= n_tokens:
        raise ScoringError(f"--stride {stride} leaves no context in a text of {n_tokens} tokens (one window over "
                           f"the whole text, as it is shorter than --ctx {ctx}): give --stride below {n_tokens}")
    return n_tokens, n_tokens - 1 if stride is None else stride


def read_text(path) -> str:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise InputFileError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputFileError(f"{path} is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start})") from None
    if "\x00" in text:
        raise InputFileError(f"{path} is not text: it holds NUL bytes (offset {text.index(chr(0))})")
    if not text.strip():
        raise InputFileError(f"{path} holds no text to score")
    return text
