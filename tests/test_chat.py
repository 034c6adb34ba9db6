"""Chat templates render the model file's own template exactly, and a hostile template gets nothing."""

import time

import pytest

from kvref.errors import TokenizerError
from kvref.text.chat import render_chat
from tests.conftest import gguf_metadata, require
from tests.gguf_writer import CHATML

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


# ---- issue 16: a hostile template renders under a step and size budget ------------------------------

HOSTILE_TEMPLATES = {
    # nested range(100000) loops rendered for 10-15 s and more
    "nested ranges": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "MAX_STEPS"),
    # found by tests/fuzz: 100,000 cheap steps that each cost a call took over 5 s on a loaded machine
    "empty inner loops": ("{% for i in range(100000) %}{% for j in range(10000 * 0) %}{% endfor %}{% endfor %}",
                          "MAX_STEPS"),
    "macro calls in a loop": ("{% macro f() %}{% endmacro %}{% for i in range(100000) %}{{ f() }}{{ f() }}"
                              "{% endfor %}", "MAX_STEPS"),
    "string methods in a loop": ("{% for i in range(100000) %}{{ messages[0].role.upper().lower().strip() }}"
                                 "{% endfor %}", "MAX_STEPS"),
    "a range too long": ("{% for i in range(10**6) %}{% endfor %}", "MAX_RANGE"),
    "a huge power": ("{{ 10 ** (10**7) }}", "MAX_INT_BITS"),  # was 10-15 s
    "a power just too large": ("{{ 2 ** 4096 }}", "MAX_INT_BITS"),
    "a huge product": ("{% set n = 10**1000 %}{{ n * n * n * n * n }}", "MAX_INT_BITS"),
    "a repeated string": ("{{ 'x' * 10**9 }}", "MAX_OUTPUT_CHARS"),
    "a doubled string": ("{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
                         "{% endfor %}", "MAX_STEPS|MAX_OUTPUT_CHARS"),  # charged by size: either comes first
    "a doubled list": ("{% set ns = namespace(s=[1]) %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}"
                       "{% endfor %}", "MAX_STEPS|MAX_OUTPUT_CHARS"),
    "a wide filter": ("{{ 'x'|center(10**9) }}", "MAX_OUTPUT_CHARS"),
    "a wide method": ("{{ 'x'.ljust(10**9) }}", "MAX_OUTPUT_CHARS"),
    "a wide % format": ("{{ '%999999999d' % 1 }}", "MAX_OUTPUT_CHARS"),
    "a wide str.format": ("{{ '{:>999999999}'.format(1) }}", "MAX_OUTPUT_CHARS"),
    "a long join": ("{{ (['a'] * 100000)|join('x' * 8000000) }}", "MAX_OUTPUT_CHARS"),
    "a long join of an iterator": ("{{ range(1000)|map('string')|join('x' * 8000000) }}", "MAX_OUTPUT_CHARS"),
    "a growing replace": ("{{ ('a' * 1000000)|replace('', 'x' * 1000) }}", "MAX_OUTPUT_CHARS"),
    "a wide indent": ("{{ ('a\n' * 100000)|indent(8000000) }}", "MAX_OUTPUT_CHARS"),
    "expandtabs": ("{{ ('\t' * 1000).expandtabs(8000) }}", "not available to templates"),
    "macros calling themselves twice": ("{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}"
                                        "{% endmacro %}{{ f(40) }}", "MAX_STEPS"),
    "loops over a long string": ("{% set s = 'x' * 4000000 %}{% for a in s %}{% for b in s %}{% endfor %}"
                                 "{% endfor %}", "MAX_STEPS"),
    "sorting a long string again and again": ("{% set s = 'x' * 4000000 %}{% for i in range(100) %}{{ s|sort|length }}"
                                              "{% endfor %}", "MAX_STEPS"),
    "a wide named % format": ("{{ '%(a)999999999s' % {'a': 1} }}", "MAX_OUTPUT_CHARS"),
    "a long join of a string": ("{{ ('a' * 100000)|join('x' * 8000000) }}", "MAX_OUTPUT_CHARS"),
    "many slices": ("{{ [1]|slice(5000000)|list|length }}", "MAX_STEPS"),
    "a huge exponent": ("{{ 2 ** (2 ** 5000) }}", "MAX_INT_BITS"),
    "a huge output": ("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", "MAX_OUTPUT_CHARS"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE_TEMPLATES))
def test_a_template_past_its_step_or_size_budget_is_a_tokenizer_error_within_a_second_or_two(name):
    template, limit = HOSTILE_TEMPLATES[name]
    start = time.perf_counter()
    with pytest.raises(TokenizerError, match=limit):
        render_chat(template, [{"role": "user", "content": "hi"}])
    assert time.perf_counter() - start < 3


def test_the_budget_leaves_what_templates_do_working():
    template = ("{% for m in messages %}{{ loop.index }}/{{ loop.length }}{{ m['content']|trim|upper }}"
                "{{ '|' if not loop.last }}{% endfor %}{{ range(3)|list }}{{ range(3)|length }}{{ 2 ** 64 }}"
                "{{ '%5d' % 7 }}{{ ['a', 'b']|join(', ') }}{{ 'ab' ~ 'cd' }}"
                "{% macro f(x) %}<{{ x }}>{% endmacro %}{{ f(1) }}{{ range(10**7, 10**7 + 2)|list }}")
    messages = [{"role": "user", "content": f" m{i} "} for i in range(3)]
    assert render_chat(template, messages) == ("1/3M0|2/3M1|3/3M2[0, 1, 2]318446744073709551616    7a, babcd<1>"
                                               "[10000000, 10000001]")


def test_a_long_conversation_renders_within_the_budget(template):
    # 2,000 messages of 2,000 characters: 4 MB of text, far more than any context holds
    messages = [{"role": "user" if i % 2 else "assistant", "content": "x" * 2000} for i in range(2000)]
    assert len(render_chat(CHATML, messages)) > 4_000_000
    assert len(render_chat(template, messages)) > 4_000_000  # SmolLM2's own


def test_each_rendering_has_its_own_budget():
    template = "{% for i in range(100000) %}{% endfor %}ok"  # 20 x 100,000 steps: four budgets
    assert [render_chat(template, []) for _ in range(20)] == ["ok"] * 20
