"""A model's text front end: what turns text into its token ids and back, how a conversation is
written for it, and what its file recommends for generating. A Model holds one (model.text); the
decoder never reads it."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import TokenizerError
from ..generation.config import GenerationConfig


@dataclass
class TextFrontEnd:
    """tokenizer: a kvref.Tokenizer (None for a model made from weights alone); chat_template: the
    file's Jinja2 template (tokenizer.chat_template); generation_config: what kvref.generate does unless
    told otherwise (the file's recommendations, else greedy)."""

    tokenizer: object = None
    chat_template: str | None = None
    generation_config: GenerationConfig = field(default_factory=GenerationConfig)

    def __post_init__(self):
        if self.chat_template is not None and not isinstance(self.chat_template, str):
            raise TokenizerError(f"a chat template (tokenizer.chat_template) is a string; this one is "
                                 f"{type(self.chat_template).__name__}")

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
