"""Chat templates render the model file's own template exactly, and a hostile template gets nothing."""

import pytest

from kvref.chat import render_chat
from kvref.errors import TokenizerError
from tests.conftest import gguf_metadata, require

CONVERSATION = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy?"},
]
# Written by hand from SmolLM2's template: a default system turn when the first message is not one,
# then <|im_start|>role\ncontent<|im_end|>\n per message, then the opening of the assistant turn.
EXPECTED = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    "<|im_start|>assistant\nParis.<|im_end|>\n"
    "<|im_start|>user\nAnd of Italy?<|im_end|>\n"
    "<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def template():
    return gguf_metadata()["tokenizer.chat_template"]


def test_smollm2_two_turn_conversation_is_the_expected_chatml(template):
    assert render_chat(template, CONVERSATION) == EXPECTED


def test_without_generation_prompt_and_with_own_system_turn(template):
    messages = [{"role": "system", "content": "Be brief."}, *CONVERSATION[:2]]
    assert render_chat(template, messages, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\nParis.<|im_end|>\n")


def test_equals_transformers_apply_chat_template_rendering(template):
    chat_template_utils = require("transformers").utils.chat_template_utils
    for add_generation_prompt in (True, False):
        rendered, _ = chat_template_utils.render_jinja_template(
            conversations=[CONVERSATION], chat_template=template, add_generation_prompt=add_generation_prompt,
            bos_token="<s>", eos_token="</s>")
        assert render_chat(template, CONVERSATION, add_generation_prompt, "<s>", "</s>") == rendered[0]


def test_trim_and_lstrip_blocks_as_hf():
    template = ("{% for m in messages %}\n    {% if m.role == 'user' %}\n[{{ m.content }}]\n"
                "    {% endif %}\n{% endfor %}")
    assert render_chat(template, CONVERSATION) == "[What is the capital of France?]\n[And of Italy?]\n"


def test_helpers_hf_templates_use():
    template = ("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m|tojson }}"
                "{% endfor %}{% set ns = namespace(n=0) %}{% set ns.n = ns.n + 1 %}{{ ns.n }}"
                "{{ dict(a='<&>')|tojson }}")
    assert render_chat(template, CONVERSATION) == (
        '{"role": "user", "content": "What is the capital of France?"}1{"a": "<&>"}')


def test_raise_exception_becomes_tokenizer_error():
    template = ("{% if messages[0].role != 'system' %}{{ raise_exception('a system turn comes first') }}"
                "{% endif %}")
    with pytest.raises(TokenizerError, match="a system turn comes first"):
        render_chat(template, CONVERSATION)


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__ }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__ }}",
    "{{ lipsum.__globals__['os'].popen('id').read() }}",
    "{{ raise_exception.__globals__ }}",
    "{{ self._TemplateReference__context }}",
    "{{ ''|attr('__class__') }}",
    "{{ messages.append({'role': 'user', 'content': 'injected'}) }}",
    "{{ messages[0].update(role='system') }}",
    "{{ dict.update(messages[0], role='system') }}",
    "{% set ns = namespace(__html__=1) %}",
    "{% set ns = namespace() %}{% set ns.__class__ = 1 %}",
    "{% include '/etc/passwd' %}",
    "{% import 'os' as os %}",
    "{% for %}",
    "{{ 1 / 0 }}",
])
def test_hostile_or_broken_template_raises_and_changes_nothing(template):
    messages = [dict(m) for m in CONVERSATION]
    with pytest.raises(TokenizerError, match="chat template failed"):
        render_chat(template, messages)
    assert messages == CONVERSATION


@pytest.mark.parametrize("messages", ["hi", [{"content": "no role"}], [{"role": "user"}], [("user", "hi")]])
def test_malformed_messages_raise(messages):
    with pytest.raises(TokenizerError, match="message"):
        render_chat("{{ messages }}", messages)
