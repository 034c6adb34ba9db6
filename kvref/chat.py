"""Chat templates: a model file's `tokenizer.chat_template` (Jinja2) rendered into prompt text.

The template comes from the model file, so it is untrusted code. It runs in jinja2's
ImmutableSandboxedEnvironment: no attribute starting with "_" (so no `__class__`, `__globals__`,
`__subclasses__`), no unsafe callables, no mutation of the lists and dicts passed in; reaching for any
of these fails the rendering. The environment has no loader, so `include`/`import` cannot reach the
file system. The options and helpers are the ones
HF transformers gives templates (`apply_chat_template`), so templates written for HF render the same;
its hardening of `dict` and `namespace` is repeated here.

Rendering is not bounded in time or memory: a hostile template can still loop long or build a huge
string (as with HF); it cannot read or change anything outside its output.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError
from jinja2.utils import Namespace

from .errors import TokenizerError


def render_chat(template: str, messages: Sequence[Mapping], add_generation_prompt: bool = True,
                bos_token: str = "", eos_token: str = "") -> str:
    """The conversation as the model expects to read it.

    messages: [{"role": "system" | "user" | "assistant", "content": str}, ...], oldest first.
    add_generation_prompt: end with the opening of an assistant turn, so the model writes the reply.
    Any template failure (syntax, a blocked attribute, the template's own raise_exception) raises
    TokenizerError.
    """
    if not isinstance(template, str):
        raise TokenizerError(f"a chat template is a str, got {type(template).__name__}")
    _check_messages(messages)
    try:
        return _compile(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=bos_token, eos_token=eos_token)
    except Exception as e:
        # an untrusted template can fail any way Python code can: syntax, a blocked attribute, its own
        # raise_exception, 1/0, deep recursion. For the caller it is one failure: this template cannot
        # render this conversation
        raise TokenizerError(f"chat template failed: {type(e).__name__}: {e}") from e


def _check_messages(messages) -> None:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TokenizerError(f"messages should be a list of dicts, got {type(messages).__name__}")
    for i, message in enumerate(messages):
        if not (isinstance(message, Mapping) and isinstance(message.get("role"), str)
                and "content" in message):
            raise TokenizerError(f"message {i} should be a dict with a str 'role' and a 'content', "
                                 f"got {message!r}")


@functools.lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    return _ENVIRONMENT.from_string(template)


def _raise_exception(message):
    """Templates call this to reject a conversation (e.g. roles out of order)."""
    raise jinja2.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # replaces jinja's own tojson, which escapes HTML characters (<, >, &, ') that prompts must keep
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(format):
    """Today's date for templates that print it (Llama 3.x)."""
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict` for templates: the builtin type would hand them unbound methods such as dict.update,
    which the sandbox's mutation check (made for bound methods) lets through."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(Namespace):
    """`namespace` for templates, refusing "_" names: a namespace answers attribute lookups from its
    own entries, so an entry named like a special method would be found by Python internals."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]  # jinja's signature trick, so that namespace(self=...) works
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"a template namespace cannot hold {name!r}: names must not start with '_'")


class _Sandbox(ImmutableSandboxedEnvironment):
    def unsafe_undefined(self, obj, attribute):
        # jinja's default is an undefined value that prints as "" until used further; a template that
        # reaches for internals is hostile, and fails here rather than render on
        raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__} object is unsafe")


def _environment() -> _Sandbox:
    # trim_blocks/lstrip_blocks: block tags leave no newline or indentation behind, as in HF
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_TemplateDict(),
                       namespace=_TemplateNamespace)
    return env


_ENVIRONMENT = _environment()
