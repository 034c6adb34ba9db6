"""A model's text front end: what turns text into its token ids and back, how a conversation is
written for it, and what its file recommends for generating. A Model holds one (model.text); the
decoder never reads it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..errors import TokenizerError
from ..generation.config import GenerationConfig
from . import templates
from .vocab import SPECIAL_TYPES, texts_of_types


@dataclass
class TextFrontEnd:
    """tokenizer: a kvref.Tokenizer (None for a model made from weights alone); chat_template: the
    file's Jinja2 template (tokenizer.chat_template), or a built-in (kvref.text.templates) where the
    file has none; generation_config: what kvref.generate does unless told otherwise (the file's
    recommendations, else greedy); chat_template_origin: (the template, how it was chosen), which
    chat_template_note reads."""

    tokenizer: object = None
    chat_template: str | None = None
    generation_config: GenerationConfig = field(default_factory=GenerationConfig)
    chat_template_origin: tuple[str | None, str] = (None, "")

    def __post_init__(self):
        if self.chat_template is not None and not isinstance(self.chat_template, str):
            raise TokenizerError(f"a chat template (tokenizer.chat_template) is a string; this one is "
                                 f"{type(self.chat_template).__name__}")

    @property
    def chat_template_note(self) -> str:
        """Which chat template this front end renders, and why."""
        template, why = self.chat_template_origin
        if self.chat_template is None:
            return "none"
        # the origin describes the template it was recorded with; model.chat_template = ... replaces both
        return why if template == self.chat_template else "the one set on the model (model.chat_template)"

    def choose_chat_template(self, architecture: str | None, own: str) -> None:
        """At load: keep the file's own template (`own` says where it came from), else detect a built-in
        from the architecture and the vocabulary's special tokens (templates.detect)."""
        if self.chat_template is not None:
            self.chat_template_origin = (self.chat_template, f"the file's own ({own})")
        elif self.tokenizer is not None:
            tok = self.tokenizer
            specials = texts_of_types(tok.tokens, tok.token_types, SPECIAL_TYPES)
            name, why = templates.detect(architecture, specials)
            self.use_builtin_template(name, f"the file has none; {why}")

    def use_chat_template(self, name_or_file: str) -> None:
        """A Jinja2 template read from a file, else the built-in of that name (--chat-template)."""
        path = Path(name_or_file)
        if path.is_file():
            try:
                template = path.read_text()
            except (OSError, UnicodeDecodeError) as exc:
                raise TokenizerError(f"cannot read the chat template {name_or_file}: {exc}") from None
            self.chat_template, self.chat_template_origin = template, (template, f"{name_or_file}, as asked")
        else:
            self.use_builtin_template(name_or_file, "as asked")

    def use_builtin_template(self, name: str, why: str) -> None:
        """Render with the built-in `name`; its end-of-turn token then ends generation, as the family's
        own files say (a converted file may list only EOS)."""
        builtin = templates.builtin_template(name)
        self.chat_template = builtin.source
        self.chat_template_origin = (builtin.source, f"built-in {name} ({builtin.family}): {why}")
        end = None if self.tokenizer is None else self.tokenizer.model.ids.get(builtin.end_of_turn)
        # only as a special token: a vocabulary may hold the same text as ordinary text ("</s>" in a code model)
        if end is not None and self.tokenizer.token_types[end] in SPECIAL_TYPES:
            self.tokenizer.eos_ids = self.tokenizer.eos_ids | {end}

    def chat_ids(self, messages, add_generation_prompt=True) -> list[int]:
        """Token ids of a conversation rendered with the chat template (special tokens as ids)."""
        text = self.chat_text(messages, add_generation_prompt)  # refuses a front end without a tokenizer
        return self.tokenizer.encode(text, special=True)

    def chat_text(self, messages, add_generation_prompt=True) -> str:
        """A conversation rendered with the chat template, before tokenization."""
        # imported here: jinja2 costs ~7 MB resident, which a process that renders no template never pays
        from .chat import render_chat

        tok = self.tokenizer
        if tok is None or not self.chat_template:
            raise TokenizerError("this model has no tokenizer or chat template (tokenizer.chat_template)")
        return render_chat(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                           bos_token=_token_text(tok, tok.bos_id), eos_token=_token_text(tok, tok.eos_id))


def _token_text(tokenizer, token_id) -> str:
    return "" if token_id is None else tokenizer.token_text(token_id)
