"""The README's Python example runs as printed."""

from pathlib import Path


def test_readme_python_example_runs(capsys):
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    code = readme.split("```python", 1)[1].split("```", 1)[0]
    exec(compile(code, "README.md", "exec"), {})
    assert " Paris." in capsys.readouterr().out
