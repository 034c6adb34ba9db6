"""kvref models: the packaged short names, the Hugging Face cache's loadable models and GGUF files in
the folders given, each with its size, and nothing downloaded or assembled to list them."""

from kvref.tools.cli import main
from tests.test_loader import fake_hf_cache


def test_models_lists_the_cache_models_kvref_reads_and_the_gguf_files_of_a_folder(tmp_path, monkeypatch, capsys):
    _, snapshot = fake_hf_cache(tmp_path / "hub")
    unreadable = tmp_path / "hub" / "models--org--bert" / "snapshots" / "r"
    unreadable.mkdir(parents=True)
    (unreadable / "config.json").write_text('{"model_type": "bert"}')  # a family kvref does not read
    (tmp_path / "ggufs" / "sub").mkdir(parents=True)
    (tmp_path / "ggufs" / "sub" / "a.gguf").write_bytes(b"GGUF" * 300)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert main(["models", str(tmp_path / "ggufs"), str(tmp_path / "nowhere")]) == 0
    out = capsys.readouterr().out
    size = sum(f.stat().st_size for f in snapshot.iterdir())
    assert "smollm2" in out and "gemma3-270m" in out
    assert f"Hugging Face cache {tmp_path / 'hub'} (-m org/name):" in out
    line = next(line for line in out.splitlines() if "org/tiny" in line)
    assert str(snapshot) in line and (f"{size / 1024:.2f} KiB" in line)
    assert "org/bert" not in out
    assert f"{tmp_path / 'ggufs' / 'sub' / 'a.gguf'}" in out and "1.17 KiB" in out
    assert "(not a folder)" in out


def test_inspect_and_conformance_take_org_name_of_the_cache(tmp_path, monkeypatch, capsys):
    _, snapshot = fake_hf_cache(tmp_path / "hub")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    assert main(["inspect", "org/tiny"]) == 0
    assert str(snapshot) in capsys.readouterr().out
    from kvref.conformance.command import _is_folder

    assert _is_folder("org/tiny") and not _is_folder("org/absent")
