"""Chat templates: a model file's `tokenizer.chat_template` (Jinja2) rendered into prompt text.

The template comes from the model file, so it is untrusted code. It runs in jinja2's
ImmutableSandboxedEnvironment: no attribute starting with "_" (so no `__class__`, `__globals__`,
`__subclasses__`), no unsafe callables, no mutation of the lists and dicts passed in; reaching for any
of these fails the rendering. The environment has no loader, so `include`/`import` cannot reach the
file system. The options and helpers are the ones
HF transformers gives templates (`apply_chat_template`), so templates written for HF render the same;
its hardening of `dict` and `namespace` is repeated here.

Rendering is bounded in work and size (a hostile template could otherwise loop for hours or build
gigabytes; HF does not bound it). Every step the template takes is charged to a budget of MAX_STEPS:
each loop item and macro call (by the size of the body it runs), each call (CALL_STEPS), filter,
operator and attribute or item lookup, each piece of output; calls, filters and operators also by the size of what
they read (one step per STEP_CHARS characters or items; item-wise filters such as sort, one per item),
and calls and filters by their integer arguments (widths and counts of what they make). `range`
gives at most MAX_RANGE items; `**` and `*` of integers may not make numbers of more than
MAX_INT_BITS bits; no string or list may grow past MAX_OUTPUT_CHARS (checked before `*`, `+`, `%`,
`~`, str.format, join, replace, indent, wordwrap and any width argument build it), and neither may
the rendered text. Going past any limit is a TokenizerError naming it.
"""

from __future__ import annotations

import contextvars
import functools
import json
import math
import re
from collections.abc import Mapping, Sequence
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.runtime import LoopContext
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError
from jinja2.utils import Namespace
from jinja2.visitor import NodeTransformer

from ..errors import TokenizerError

# A chat template renders under these limits (module docstring). Real templates take tens of steps
# per message (ChatML, Llama 3, Gemma and SmolLM2's templates: 36k to 216k steps for 2,000 messages of
# 2,000 characters, far more than any context holds); the hostile templates of tests/test_chat.py
# use up the budget in well under a second, and none builds more than a few hundred MB.
MAX_STEPS = 500_000
STEP_CHARS = 256  # a call, filter or operator reading n characters or items costs 1 + n // STEP_CHARS steps
CALL_STEPS = 10  # a call from a template (the sandbox's checks, a Python call) costs about as much as ~10 loop items
MAX_RANGE = 100_000  # items of one range(), as jinja's own sandbox
MAX_INT_BITS = 4096  # integers a template computes (10 ** 1233 fits, 10 ** (10 ** 7) does not)
MAX_OUTPUT_CHARS = 2**23  # ~8.4 M characters: the rendered text, and any string or list built on the way


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
    token = _BUDGET.set(_Budget())
    try:
        pieces = _compile(template).generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                             bos_token=bos_token, eos_token=eos_token)
        return _bounded_join(pieces)
    except Exception as e:
        # an untrusted template can fail any way Python code can: syntax, a blocked attribute, its own
        # raise_exception, 1/0, deep recursion. For the caller it is one failure: this template cannot
        # render this conversation
        raise TokenizerError(f"chat template failed: {type(e).__name__}: {e}") from e
    finally:
        _BUDGET.reset(token)


def _bounded_join(pieces) -> str:
    out, size = [], 0
    for piece in pieces:
        _charge(1)
        size += len(piece)
        if size > MAX_OUTPUT_CHARS:
            raise SecurityError(f"the rendered text passes {MAX_OUTPUT_CHARS:,} characters (MAX_OUTPUT_CHARS)")
        out.append(piece)
    return "".join(out)


class _Budget:
    """The steps left to the rendering under way."""

    def __init__(self):
        self.steps = MAX_STEPS


# per rendering: a compiled template is shared between threads, the budget is not
_BUDGET: contextvars.ContextVar[_Budget] = contextvars.ContextVar("kvref_chat_budget")


def _charge(steps: int) -> None:
    budget = _BUDGET.get(None)
    if budget is None:  # jinja folding constants while it compiles: the size checks still apply
        return
    budget.steps -= steps
    if budget.steps < 0:
        raise SecurityError(f"the template took more than {MAX_STEPS:,} steps (MAX_STEPS)")


def _size(value) -> int:
    return len(value) if isinstance(value, (str, bytes, list, tuple, dict)) else 0


def _charge_for(*values) -> None:
    _charge(1 + sum(_size(v) for v in values) // STEP_CHARS)


def _charge_call(value, args, kwargs) -> None:
    """A call or filter: by the size of what it reads, and by every integer argument, which is at most a
    size or a count of what it makes (a width, a number of slices or batches)."""
    numbers = [abs(v) for v in (*args, *kwargs.values()) if isinstance(v, int) and not isinstance(v, bool)]
    _charge_for(value, *args, *kwargs.values())
    _charge(min(sum(numbers), MAX_STEPS + 1))


def _check_size(n: int, what: str) -> None:
    if n > MAX_OUTPUT_CHARS:
        raise SecurityError(f"{what} would make {n:,} characters or items, more than {MAX_OUTPUT_CHARS:,} "
                            "(MAX_OUTPUT_CHARS)")


def _check_int(n: int, what: str) -> None:
    if n.bit_length() > MAX_INT_BITS:
        raise SecurityError(f"{what} would make an integer of more than {MAX_INT_BITS} bits (MAX_INT_BITS)")


class _Range(Sequence):
    """range() for templates: at most MAX_RANGE items, each charged a step as it is produced."""

    def __init__(self, *args):
        self._range = range(*args)
        if len(self._range) > MAX_RANGE:
            raise SecurityError(f"range of {len(self._range):,} items; the limit is {MAX_RANGE:,} (MAX_RANGE)")

    def __len__(self):
        return len(self._range)

    def __getitem__(self, index):
        return self._range[index]

    def __iter__(self):
        return _charged(self._range)


def _charged(iterable, steps=1):
    """Items of `iterable`, each charged `steps`: what every template loop iterates over."""
    for item in iterable:
        _charge(steps)
        yield item


# filters that handle each item (or character) of their input as a Python object: charged a step per
# item, where the others (C-speed string work) are charged per STEP_CHARS
_ITEMWISE_FILTERS = frozenset({"sort", "unique", "map", "select", "reject", "selectattr", "rejectattr", "groupby",
                               "batch", "slice", "list", "sum", "min", "max", "dictsort", "join", "random", "items",
                               "xmlattr", "tojson", "pprint", "wordcount", "title", "capitalize", "urlize"})
# str methods whose output can be any multiple of their input (tabs x tabsize, a table of long strings)
_UNBOUNDED_STR_METHODS = frozenset({"expandtabs", "translate", "maketrans"})
_FORMAT_NUMBERS = re.compile(r"(?:%(?:\([^)]*\))?[^a-zA-Z%]*[a-zA-Z%])|(?:\{[^{}]*\})")


def _check_format(fmt: str, what: str) -> None:
    # printf-style and str.format fields: a width or precision is a string that size, built at once
    for field in _FORMAT_NUMBERS.findall(fmt):
        if "*" in field and field.startswith("%"):
            raise SecurityError(f"{what}: a '*' width is not allowed in templates")
        for number in re.findall(r"\d+", field):
            _check_size(int(number) if len(number) < 12 else MAX_OUTPUT_CHARS + 1, f"{what} width {number[:12]}")


def _check_arguments(args, kwargs, what: str) -> None:
    # an integer argument is at most a size: widths (center, ljust, zfill, indent, wordwrap, tojson's
    # indent), counts and lengths; none of them may ask for more than MAX_OUTPUT_CHARS
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_OUTPUT_CHARS:
            raise SecurityError(f"{what} with the argument {value} (more than MAX_OUTPUT_CHARS)")


def _check_join(items, sep) -> None:
    if isinstance(items, (str, list, tuple)) and isinstance(sep, str):
        _check_size(len(sep) * len(items) + sum(_size(i) for i in items), "join")


def _check_growth(name: str, value, args, kwargs) -> None:
    """Before a filter or str method that multiplies its input runs: the size of what it would make."""
    if not isinstance(value, str):
        return
    if name == "join":  # the str method: value is the separator
        _check_join(args[0] if args else (), value)
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        _check_size(len(value) + (value.count(args[0]) if args[0] else len(value) + 1) * len(args[1]), "replace")
    elif name == "indent":
        width = args[0] if args else kwargs.get("width", 4)
        width = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
        _check_size(len(value) + (value.count("\n") + 1) * width, "indent")
    elif name == "wordwrap":
        wrap = args[2] if len(args) > 2 else kwargs.get("wrapstring", "\n")
        _check_size(len(value) * (1 + _size(wrap)), "wordwrap")
    elif name in _UNBOUNDED_STR_METHODS:
        raise SecurityError(f"str.{name} is not available to templates: its output is not bounded by its input")
    elif name in ("format", "format_map") or name == "%":
        _check_format(value, name)


def _guarded_filter(name, f):
    """A filter charged by the size of its input and checked before it can multiply it."""

    @functools.wraps(f)  # keeps jinja_pass_arg (pass_context, pass_environment, ...)
    def filter_(*args, **kwargs):
        value_at = 1 if getattr(f, "jinja_pass_arg", None) is not None else 0
        value, rest = (args[value_at], args[value_at + 1:]) if len(args) > value_at else (None, ())
        if name == "join" and not isinstance(value, (str, list, tuple, dict)):
            value = list(_charged(value))  # an iterator joined is counted and sized first
            args = (*args[:value_at], value, *rest)
        _check_arguments(rest, kwargs, f"the filter {name}")
        if name == "join":
            _check_join(value, rest[0] if rest else kwargs.get("d", ""))
        else:
            _check_growth(name, value, rest, kwargs)
        _charge(len(value) if name in _ITEMWISE_FILTERS and _size(value) else 0)
        _charge_call(value, rest, kwargs)
        return f(*args, **kwargs)

    return filter_


class _Budgeted(NodeTransformer):
    """Rewrites a parsed template so that its loops, macros and `~` are charged and bounded: each loop
    item and each macro call costs 1 + the number of nodes in its body (what one pass through the
    body can evaluate), and `a ~ b` is checked before it is built."""

    def visit_For(self, node):
        self.generic_visit(node)
        node.iter = _call(_CHARGED_NAME, [node.iter, nodes.Const(1 + _node_count(node.body))], node.iter.lineno)
        return node

    def visit_Macro(self, node):
        self.generic_visit(node)
        node.body = [nodes.Output([_call(_CHARGE_NAME, [nodes.Const(1 + _node_count(node.body))], node.lineno)],
                                  lineno=node.lineno), *node.body]
        return node

    visit_CallBlock = visit_Macro

    def visit_Concat(self, node):
        self.generic_visit(node)
        return _call(_CONCAT_NAME, node.nodes, node.lineno)


def _call(name, args, lineno):
    return nodes.Call(nodes.Name(name, "load"), args, [], None, None, lineno=lineno)


def _node_count(body) -> int:
    return sum(1 + sum(1 for _ in n.find_all(nodes.Node)) for n in body)


def _charge_steps(steps) -> str:
    _charge(steps)
    return ""


def _concat(*parts) -> str:
    texts = [str(p) for p in parts]
    _check_size(sum(map(len, texts)), "~")
    return "".join(texts)


_CHARGED_NAME, _CHARGE_NAME, _CONCAT_NAME = "kvref_charged_loop", "kvref_charge", "kvref_concat"


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
    # operators whose result can be far larger than their operands: checked before they run
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def _parse(self, source, name, filename):
        tree = _Budgeted().visit(super()._parse(source, name, filename))
        tree.set_environment(self)
        return tree

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's signature)
        _charge(CALL_STEPS)
        if __obj is not _Range:  # range charges its own items
            _check_arguments(args, kwargs, f"the call {getattr(__obj, '__name__', type(__obj).__name__)}")
            _charge_call(None, args, kwargs)
        if isinstance(__obj, LoopContext) and args:  # a recursive loop's next level iterates here
            args = (_charged(args[0]), *args[1:])
        return super().call(__context, __obj, *args, **kwargs)

    def call_binop(self, context, operator, left, right):
        _charge_for(left, right)
        _check_binop(operator, left, right)
        return super().call_binop(context, operator, left, right)

    def getattr(self, obj, attribute):
        _charge(1)
        return _guard_str_method(obj, attribute, super().getattr(obj, attribute))

    def getitem(self, obj, argument):
        _charge(1)
        return _guard_str_method(obj, argument, super().getitem(obj, argument))

    def unsafe_undefined(self, obj, attribute):
        # jinja's default is an undefined value that prints as "" until used further; a template that
        # reaches for internals is hostile, and fails here rather than render on
        raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__} object is unsafe")


def _guard_str_method(obj, name, value):
    """A method of a string, as a template gets it: charged by the string's size and checked before it
    can multiply it (the sandbox hands templates bound methods, jinja's str.format already wrapped)."""
    if not (isinstance(obj, str) and isinstance(name, str) and callable(value)):
        return value

    def method(*args, **kwargs):
        if name == "join" and args and not isinstance(args[0], (str, list, tuple, dict)):
            args = (list(_charged(args[0])), *args[1:])  # an iterator joined is counted and sized first
        _check_arguments(args, kwargs, f"str.{name}")
        _check_growth(name, obj, args, kwargs)
        _charge_call(obj, args, kwargs)
        return value(*args, **kwargs)

    return method


def _check_binop(operator, left, right) -> None:
    ints = all(isinstance(v, int) for v in (left, right))
    if operator == "**" and ints and right > 0 and abs(left) > 1:
        # the result has about right * log2|left| bits; refused before Python computes it
        bits = min(right, MAX_INT_BITS + 1) * math.log2(abs(left))
        _check_int(1 << min(int(bits) + 1, MAX_INT_BITS + 1), f"{str(left)[:20]} ** {str(right)[:20]}")
    elif operator == "*" and ints:
        _check_int(1 << min(abs(left).bit_length() + abs(right).bit_length(), MAX_INT_BITS + 1), "*")
    elif operator == "*":
        sized, count = (left, right) if isinstance(right, int) else (right, left)
        if isinstance(count, int) and _size(sized):
            _check_size(_size(sized) * max(count, 0), "*")
    elif operator == "+" and _size(left) and _size(right):
        _check_size(_size(left) + _size(right), "+")
    elif operator == "%" and isinstance(left, str):
        _check_growth("%", left, (), {})


def _environment() -> _Sandbox:
    # trim_blocks/lstrip_blocks: block tags leave no newline or indentation behind, as in HF
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.filters = {name: _guarded_filter(name, f) for name, f in env.filters.items()}
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_TemplateDict(),
                       namespace=_TemplateNamespace, range=_Range,
                       **{_CHARGED_NAME: _charged, _CHARGE_NAME: _charge_steps, _CONCAT_NAME: _concat})
    return env


_ENVIRONMENT = _environment()
