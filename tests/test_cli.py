import pytest

from kvref.cli import main


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
