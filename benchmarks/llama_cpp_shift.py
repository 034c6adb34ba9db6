"""What llama.cpp's context shift does to a cache, told apart by which reference its continuation matches.

    PYTHONPATH=. /work/llama-venv/bin/python benchmarks/llama_cpp_shift.py FILE.gguf

The conformance suite's context_shift check (the quick plan's first prompt, 53 positions; keep 4 drop 19,
keep 1 drop 16; the last prompt's first 6 ids as the continuation) runs on llama.cpp, and the continuation
is compared (max KL) with three references built from the float32 spec's stored keys: the spec's shift
(kvref.conformance.spec.Spec.shifted: moved keys rotated back, NoPE layers' keys as stored), the same with
the NoPE layers' keys rotated too, and the same with every kept key multiplied by the file's LongRoPE
attention factor. docs/conformance.md has the figures for the converted SmolLM3 and Phi-3 files.
"""

from __future__ import annotations

import sys

import numpy as np

import kvref
from kvref.conformance import Spec, make_plan
from kvref.conformance.engine import Rows
from kvref.conformance.llama_engine import LlamaCppEngine
from kvref.conformance.spec import divergence
from kvref.spec import ops


def shifted(model, ids, n, keep, continuation, rotate_nope=False, key_scale=1.0):
    """[len(continuation), V]: Spec.shifted's reference, with the NoPE layers' keys rotated too and every
    kept key times key_scale when asked."""
    c = model.config
    run = model.new_cache(layout="contiguous", capacity=len(ids))
    model.forward(list(ids), run)
    kept = np.r_[0:keep, keep + n:len(ids)]
    moved = kept >= keep + n
    k = np.stack([np.array(run.keys(layer))[kept] for layer in range(c.n_layers)])  # [L, S, Hkv, D]
    v = np.stack([np.array(run.values(layer))[kept] for layer in range(c.n_layers)])
    for layer in range(c.n_layers):
        rope = c.layer_rope(layer) or (c.layer_rope(0) if rotate_nope else None)
        if rope is not None:
            k[layer, moved] = ops.rope(k[layer, moved], np.full(int(moved.sum()), -n), *rope)
    cache = model.new_cache(layout="contiguous", capacity=len(kept) + len(continuation))
    cache.append(k * key_scale, v)
    return Rows.from_logits(model.forward(list(continuation), cache, all_logits=True)).full


def main(path):
    model = kvref.load(path, backend="numpy", dtype="float32")
    spec, plan = Spec(model), make_plan(model)
    engine = LlamaCppEngine(path, spec.vocab_size, 160)
    c = model.config
    longrope = c.rope_scaling is not None and c.rope_scaling[0] == "longrope" and c.attention_scale is not None
    factor = float(np.sqrt(c.attention_scale * c.head_dim ** 0.5)) if longrope else 1.0
    ids, continuation = plan.prompts[0][:3 * plan.block_size + 5], plan.prompts[-1][:6]
    for keep, n in ((4, plan.block_size + 3), (1, plan.block_size)):
        seq = engine.new_sequence()
        engine.forward(seq, ids, last_only=True)
        engine.shift(seq, n, keep)
        theirs = engine.forward(seq, continuation)
        engine.free(seq)
        references = {"the spec's shift": spec.shifted(ids, n, keep, continuation),
                      "NoPE keys rotated too": shifted(model, ids, n, keep, continuation, rotate_nope=True),
                      f"every kept key x {factor:.3g}": shifted(model, ids, n, keep, continuation, key_scale=factor)}
        for name, reference in references.items():
            print(f"keep {keep} drop {n}: against {name}: max KL {divergence(reference, theirs).kl.max():.2g}")
    engine.close()


if __name__ == "__main__":
    main(sys.argv[1])
