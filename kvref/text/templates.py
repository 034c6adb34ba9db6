"""Built-in chat templates: how each family lays out a conversation, for a model file that carries no
template of its own (a pretrained model such as gemma3-270m, a converted file that lost it).

Each is a Jinja2 template in the style of its family's own, and renders what the family's own
template renders for conversations of system, user and assistant text (tests/test_chat_templates.py
compares them). Jinja rather than Python: a built-in then goes the one way a file's template goes
(kvref.text.chat's sandbox and budget, the same bos_token/eos_token), and reads side by side with
the family's own. Tool calls, images and other content parts are left out: a model that needs them
carries its own template.

A built-in is chosen by name (`--chat-template gemma`, TextFrontEnd.use_chat_template) or detected
(detect): by the special tokens of the model's vocabulary first, which name the family's turn format
whatever the architecture (a Llama 3 vocabulary is Llama 3's format, a ChatML vocabulary ChatML's),
then by the architecture, then ChatML, llama.cpp's own fallback.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import TokenizerError


@dataclass(frozen=True)
class BuiltinTemplate:
    """source: the Jinja2 template; end_of_turn: the token text that ends an assistant turn, which must
    end a reply even where the file does not list it among its end ids; family: who writes this format."""

    source: str
    end_of_turn: str
    family: str


_CHATML = """\
{% for message in messages %}
{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' -}}
{% endfor %}
{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"""

# Llama 2 chat: every user turn opens with BOS and [INST]; the system text goes inside the first one,
# between <<SYS>> markers; an assistant turn ends with EOS. The format has no generation prompt: the
# reply follows [/INST].
_LLAMA2 = """\
{% if messages and messages[0]['role'] == 'system' %}
{% set system = '<<SYS>>\n' + messages[0]['content'] + '\n<</SYS>>\n\n' %}{% set turns = messages[1:] %}
{% else %}{% set system = '' %}{% set turns = messages %}{% endif %}
{% for message in turns %}
{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
{{ raise_exception('after an optional system message, Llama 2 turns alternate user, assistant, user, ...') -}}
{% endif %}
{% if message['role'] == 'user' %}
{{ bos_token + '[INST] ' + ((system if loop.first else '') + message['content']).strip() + ' [/INST]' -}}
{% else %}{{ ' ' + message['content'].strip() + ' ' + eos_token }}{% endif %}
{% endfor %}"""

_LLAMA3 = """\
{{ bos_token -}}
{% for message in messages %}
{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' -}}
{% endfor %}
{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"""

# Mistral Instruct (mistralai's v1 format, Mistral 7B Instruct v0.2's template): [INST] ... [/INST] turns
# after one BOS; a system text opens the first user turn, a blank line after it.
_MISTRAL = """\
{% if messages and messages[0]['role'] == 'system' %}
{% set system = messages[0]['content'] + '\n\n' %}{% set turns = messages[1:] %}
{% else %}{% set system = '' %}{% set turns = messages %}{% endif %}
{{ bos_token -}}
{% for message in turns %}
{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
{{ raise_exception('after an optional system message, Mistral turns alternate user, assistant, user, ...') -}}
{% endif %}
{% if message['role'] == 'user' %}
{{ ' [INST] ' + (system if loop.first else '') + message['content'] + ' [/INST]' -}}
{% else %}{{ ' ' + message['content'] + eos_token }}{% endif %}
{% endfor %}"""

# Gemma (1 to 3): the assistant's role is "model"; Gemma has no system turn, so a system text opens
# the first user turn, a blank line after it.
_GEMMA = """\
{{ bos_token -}}
{% if messages and messages[0]['role'] == 'system' %}
{% set system = messages[0]['content'] + '\n\n' %}{% set turns = messages[1:] %}
{% else %}{% set system = '' %}{% set turns = messages %}{% endif %}
{% for message in turns %}
{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
{{ raise_exception('after an optional system message, Gemma turns alternate user, assistant, user, ...') -}}
{% endif %}
{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n' -}}
{{ (system if loop.first else '') + message['content'] | trim + '<end_of_turn>\n' -}}
{% endfor %}
{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"""

_PHI3 = """\
{{ bos_token -}}
{% for message in messages %}
{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' -}}
{% endfor %}
{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"""

# DeepSeek R1 and its Llama and Qwen distills: the system text first, bare; an assistant turn keeps
# only what follows its reasoning (</think>); the reply opens with <think>.
_DEEPSEEK_R1 = """\
{{ bos_token -}}
{% for message in messages if message['role'] == 'system' %}{% if loop.last %}{{ message['content'] }}{% endif %}
{% endfor %}
{% for message in messages %}
{% if message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] -}}
{% elif message['role'] == 'assistant' %}
{{ '<｜Assistant｜>' + message['content'].split('</think>')[-1] + '<｜end▁of▁sentence｜>' -}}
{% endif %}
{% endfor %}
{% if add_generation_prompt %}{{ '<｜Assistant｜><think>\n' }}{% endif %}"""

BUILTIN_TEMPLATES = {
    "chatml": BuiltinTemplate(_CHATML, "<|im_end|>", "ChatML: Qwen 2/2.5/3, SmolLM, OpenHermes"),
    "llama2": BuiltinTemplate(_LLAMA2, "</s>", "Llama 2 chat"),
    "llama3": BuiltinTemplate(_LLAMA3, "<|eot_id|>", "Llama 3, 3.1, 3.2, 3.3"),
    "mistral": BuiltinTemplate(_MISTRAL, "</s>", "Mistral 7B Instruct v0.2, mistralai's v1 format"),
    "gemma": BuiltinTemplate(_GEMMA, "<end_of_turn>", "Gemma, Gemma 2, Gemma 3"),
    "phi3": BuiltinTemplate(_PHI3, "<|end|>", "Phi-3, Phi-3.5"),
    "deepseek-r1": BuiltinTemplate(_DEEPSEEK_R1, "<｜end▁of▁sentence｜>", "DeepSeek R1 and its Llama/Qwen distills"),
}

# Detection, in order: a template whose special tokens are all in the vocabulary; else one made for
# the architecture (general.architecture, config.json's model_type). A llama file that gets this far
# has none of Llama 3's, ChatML's or Mistral's tokens: a SentencePiece vocabulary as Llama 2's.
_BY_TOKENS = (("gemma", ("<start_of_turn>", "<end_of_turn>")),
              ("llama3", ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")),
              ("deepseek-r1", ("<｜User｜>", "<｜Assistant｜>")),
              ("phi3", ("<|user|>", "<|assistant|>", "<|end|>")),
              ("chatml", ("<|im_start|>", "<|im_end|>")),
              ("mistral", ("[INST]", "[/INST]")))
_BY_ARCHITECTURE = {"gemma": "gemma", "gemma2": "gemma", "gemma3": "gemma", "gemma3_text": "gemma",
                    "phi3": "phi3", "qwen2": "chatml", "qwen3": "chatml", "mistral": "mistral", "llama": "llama2"}
FALLBACK = "chatml"


def builtin_template(name: str) -> BuiltinTemplate:
    """The built-in template `name`; TokenizerError naming those that exist."""
    if name not in BUILTIN_TEMPLATES:
        raise TokenizerError(f"no chat template file or built-in named {name!r}; the built-ins are "
                             f"{', '.join(BUILTIN_TEMPLATES)}")
    return BUILTIN_TEMPLATES[name]


def detect(architecture: str | None, vocabulary) -> tuple[str, str]:
    """(name, why) of the built-in for a model without a template: its architecture (None if unknown)
    and its vocabulary's special tokens (texts of control and user-defined tokens, a container)."""
    for name, tokens in _BY_TOKENS:
        if all(token in vocabulary for token in tokens):
            return name, f"its vocabulary has {', '.join(tokens)}"
    if architecture in _BY_ARCHITECTURE:
        return _BY_ARCHITECTURE[architecture], f"its architecture is {architecture}"
    return FALLBACK, "nothing in the file names a turn format; ChatML is llama.cpp's fallback too"
