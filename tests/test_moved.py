"""kvref.moved: old module paths and names keep working for one release, each use warning where they are now."""

import importlib
import subprocess
import sys

import pytest

import kvref
import kvref.batch  # an old module path, imported as users did
from kvref.moved import MOVED_MODULES


@pytest.mark.parametrize("old", sorted(MOVED_MODULES))
def test_every_old_module_path_gives_the_new_modules_names_with_a_warning(old):
    new = importlib.import_module(MOVED_MODULES[old])
    name = next(n for n in vars(new) if not n.startswith("_") and not isinstance(vars(new)[n], type(sys)))
    with pytest.warns(DeprecationWarning, match=f"{old} is deprecated; use {MOVED_MODULES[old]}"):
        value = getattr(importlib.import_module(old), name)
    assert value is getattr(new, name)


def test_an_old_path_read_as_an_attribute_and_the_generate_function_stay_apart():
    with pytest.warns(DeprecationWarning):
        from kvref.generate import resume  # the old module path of kvref.generate and kvref.resume
    assert resume is kvref.resume and callable(kvref.generate) and kvref.generate.__name__ == "generate"
    with pytest.warns(DeprecationWarning, match="kvref.batch is deprecated"):
        assert kvref.batch.Engine is importlib.import_module("kvref.generation.batch").Engine
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        kvref.nothing  # noqa: B018


def test_an_old_path_imports_nothing_until_a_name_is_read():
    code = "import sys, kvref, kvref.serve; print('kvref.serving.app' in sys.modules, 'starlette' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_python_dash_m_kvref_is_the_command():
    out = subprocess.run([sys.executable, "-m", "kvref", "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.strip().endswith(kvref.__version__)


def test_the_chat_of_a_model_moved_to_its_text_front_end():
    model = kvref.load()
    messages = [{"role": "user", "content": "Hi"}]
    with pytest.warns(DeprecationWarning, match=r"model.text.chat_ids"):
        assert model.chat_ids(messages) == model.text.chat_ids(messages)
    assert model.tokenizer is model.text.tokenizer and model.generation_config is model.text.generation_config
