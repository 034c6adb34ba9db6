"""Tokenizers read from model files: byte-level BPE and SentencePiece-style BPE behind one API.

    core.py           Tokenizer (encode, decode, decode_stream, token_text, ...) and StreamDecoder
    bytelevel.py      byte-level BPE (GPT-2, SmolLM, Llama 3, Qwen) and the pre-tokenizer regexes
    sentencepiece.py  SentencePiece-style BPE ("▁" for spaces, byte fallback): Llama 2, Mistral, Gemma
    gguf.py           a Tokenizer from GGUF metadata, as llama.cpp reads it
    hf.py             a Tokenizer from a Hugging Face tokenizer.json (+ tokenizer_config.json)

docs/tokenizer.md walks through them.
"""

from .bytelevel import GPT2_REGEX, PRE_TOKENIZERS
from .core import StreamDecoder, Tokenizer
from .vocab import BYTE, CONTROL, NORMAL, UNKNOWN, UNUSED, USER_DEFINED

__all__ = ["Tokenizer", "StreamDecoder", "PRE_TOKENIZERS", "GPT2_REGEX",
           "NORMAL", "UNKNOWN", "CONTROL", "USER_DEFINED", "UNUSED", "BYTE"]
