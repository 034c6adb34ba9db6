"""The parts of a Tokenizer from a Hugging Face checkpoint directory: tokenizer.json, tokenizer_config.json,
generation_config.json (and chat_template.jinja).

tokenizer.json describes a pipeline (normalizer, pre-tokenizer, model, post-processor, decoder).
kvref reads the two pipelines its families use and refuses any other component or option by name:

  byte-level BPE (GPT-2, Llama 3, Qwen):  normalizer none or NFC; pre-tokenizer Split (regex or
      string, "Isolated"), Digits and ByteLevel (use_regex: GPT-2's regex), alone or in a Sequence;
      decoder ByteLevel.
  SentencePiece-style BPE (Llama 2, Mistral, Gemma):  spaces become "▁" by a Replace normalizer
      and/or a Metaspace pre-tokenizer, "▁" prepended by a Prepend normalizer or Metaspace's
      prepend_scheme; byte_fallback; decoder Metaspace, or Replace/ByteFallback/Fuse/Strip.

The model is BPE (vocab + merges, as "a b" strings or [a, b] pairs); added_tokens join the
vocabulary (special -> control tokens, matched only with special=True; others -> user-defined,
always matched); they must be matched as written (normalized false, or no normalizer to apply) and
without lstrip/rstrip/single_word. BOS/EOS: tokenizer_config.json's add_bos_token / add_eos_token,
else the post-processor's template. End of generation: the EOS token and generation_config.json's
eos_token_id (an int or a list).
"""

from __future__ import annotations

from pathlib import Path

import regex

from ..errors import TokenizerError
from ..limits import read_json_file
from .bytelevel import GPT2_REGEX, ByteLevelBPE
from .sentencepiece import SPACE, SentencePieceBPE
from .vocab import BYTE, CONTROL, NORMAL, SPECIAL_TYPES, UNKNOWN, USER_DEFINED, texts_of_types


def tokenizer_parts(directory: Path) -> dict:
    """Tokenizer's constructor arguments."""
    spec = _json_object(directory / "tokenizer.json")
    config = _json_object(directory / "tokenizer_config.json", missing_ok=True)
    generation = _json_object(directory / "generation_config.json", missing_ok=True)
    tokens, token_types = _vocabulary(spec)
    ids = {text: i for i, text in enumerate(tokens)}
    add_bos, add_eos, template_ids = _post_processor(spec.get("post_processor"), ids)
    bos_id = _special_id(config, "bos_token", ids, template_ids.get("bos"))
    eos_id = _special_id(config, "eos_token", ids, template_ids.get("eos"))
    return dict(
        tokens=tokens, token_types=token_types, model=_encoder(spec, tokens, token_types),
        bos_id=bos_id, eos_id=eos_id,
        add_bos=_flag(config, "add_bos_token", add_bos), add_eos=_flag(config, "add_eos_token", add_eos),
        eos_ids=_generation_eos_ids(generation))


# ---- the vocabulary ----------------------------------------------------------------------------------

def _vocabulary(spec: dict) -> tuple[list[str], list[int]]:
    """Tokens by id from model.vocab and added_tokens, with llama.cpp's token types."""
    model = _object(spec, "model")
    if model.get("type", "BPE") != "BPE":
        raise TokenizerError(f"tokenizer.json model type {model.get('type')!r} is not supported; kvref reads BPE")
    by_id = {}
    for text, i in _object(model, "vocab", "model.").items():
        _place(by_id, i, text, NORMAL, "model.vocab")
    for added in _list(spec, "added_tokens"):
        _check_added(added)
        i, text = added["id"], added["content"]
        if by_id.get(i, (text,))[0] != text:
            raise TokenizerError(f"added token {text!r} has id {i}, which model.vocab gives {by_id[i][0]!r}")
        by_id[i] = (text, CONTROL if added.get("special") else USER_DEFINED)
    missing = sorted(set(range(len(by_id))) - set(by_id))
    if missing:
        raise TokenizerError(f"tokenizer.json gives no token for ids {missing[:5]}: ids should be 0..n-1")
    tokens = [by_id[i][0] for i in range(len(by_id))]
    types = [by_id[i][1] for i in range(len(by_id))]
    if model.get("byte_fallback"):
        types = [BYTE if kind == NORMAL and _is_byte_token(t) else kind for t, kind in zip(tokens, types)]
    unk = model.get("unk_token")
    if unk is not None:
        if unk not in tokens:
            raise TokenizerError(f"model.unk_token {unk!r} is not in the vocabulary")
        if types[tokens.index(unk)] == NORMAL:
            types[tokens.index(unk)] = UNKNOWN
    return tokens, types


def _place(by_id: dict, i, text, kind, where: str) -> None:
    if not isinstance(i, int) or isinstance(i, bool) or i < 0 or not isinstance(text, str):
        raise TokenizerError(f"{where} entry {text!r}: {i!r} should map a string to an id >= 0")
    if i in by_id:
        raise TokenizerError(f"{where} gives id {i} to both {by_id[i][0]!r} and {text!r}")
    by_id[i] = (text, kind)


def _check_added(added) -> None:
    if not isinstance(added, dict) or not isinstance(added.get("content"), str) or not isinstance(added.get("id"), int):
        raise TokenizerError(f"added token {added!r} should have a str content and an int id")
    for flag in ("single_word", "lstrip", "rstrip"):
        if added.get(flag):
            raise TokenizerError(f"added token {added['content']!r} sets {flag}, which kvref does not support")


def _is_byte_token(text: str) -> bool:
    return len(text) == 6 and text.startswith("<0x") and text.endswith(">") and \
        all(c in "0123456789ABCDEF" for c in text[3:5])


# ---- the pipeline --------------------------------------------------------------------------------------

def _encoder(spec: dict, tokens: list[str], token_types: list[int]):
    model = spec["model"]
    for option, harmless in (("dropout", None), ("continuing_subword_prefix", None), ("end_of_word_suffix", None)):
        if model.get(option) not in (harmless, ""):
            raise TokenizerError(f"tokenizer.json model.{option} = {model[option]!r} is not supported")
    merges = [_merge_pair(m, rank) for rank, m in enumerate(_list(model, "merges", "model."))]
    normalizer = _normalizer(spec.get("normalizer"))
    steps = _pre_tokenizer(spec.get("pre_tokenizer"))
    _check_added_normalization(spec, normalizer)
    if any(kind == "ByteLevel" for kind, _ in steps):
        return _byte_level(spec, tokens, texts_of_types(tokens, token_types, SPECIAL_TYPES), merges, normalizer, steps)
    return _sentencepiece(spec, tokens, token_types, merges, normalizer, steps)


def _byte_level(spec, tokens, specials, merges, normalizer, steps) -> ByteLevelBPE:
    if normalizer - {"NFC"}:
        raise TokenizerError(f"normalizer {sorted(normalizer - {'NFC'})} with a ByteLevel pre-tokenizer is not supported")
    if any(kind in ("Metaspace", "SpaceMergedWithPrevious") for kind, _ in steps):
        raise TokenizerError("a pre-tokenizer with ByteLevel and Metaspace or a MergedWithPrevious split "
                             "is not supported")
    _decoder_types(spec.get("decoder"), {"ByteLevel"})
    patterns = [p for kind, p in steps if p is not None]
    return ByteLevelBPE(tokens, merges, patterns, "tokenizer.json", nfc="NFC" in normalizer,
                        ignore_merges=bool(spec["model"].get("ignore_merges")), specials=specials)


def _sentencepiece(spec, tokens, token_types, merges, normalizer, steps) -> SentencePieceBPE:
    metaspace = [options for kind, options in steps if kind == "Metaspace"]
    splits = [(kind, p) for kind, p in steps if kind != "Metaspace"]
    # a Split on " " after spaces became "▁" finds nothing (Gemma's tokenizer.json has one)
    if splits and not ("Replace" in normalizer and splits == [("SpaceMergedWithPrevious", None)]):
        raise TokenizerError(f"pre-tokenizer splits {splits} without ByteLevel are not supported")
    if not metaspace and "Replace" not in normalizer:
        raise TokenizerError("tokenizer.json has neither ByteLevel nor a space -> '▁' Replace or Metaspace: "
                             "kvref reads byte-level and SentencePiece-style BPE only")
    if metaspace and "Prepend" in normalizer:
        raise TokenizerError("a Prepend normalizer together with a Metaspace pre-tokenizer is not supported")
    prefix, split_words = ("every" if "Prepend" in normalizer else "never"), False
    if metaspace:
        prefix, split_words = metaspace[0]
    model = spec["model"]
    decoder_types = _decoder_types(spec.get("decoder"), {"Metaspace", "Replace", "ByteFallback", "Fuse", "Strip"})
    if ("Strip" in decoder_types or "Metaspace" in decoder_types) != (prefix != "never"):
        raise TokenizerError("the decoder and the normalizer disagree on the space prefix (a Strip or "
                             "Metaspace decoder exactly when '▁' is prepended)")
    unk = model.get("unk_token")
    return SentencePieceBPE(tokens, token_types, merges=merges, space_prefix=prefix, split_words=split_words,
                            nfc="NFC" in normalizer, unk_id=None if unk is None else tokens.index(unk),
                            fuse_unk=bool(model.get("fuse_unk")), ignore_merges=bool(model.get("ignore_merges")))


def _normalizer(normalizer) -> set[str]:
    """The normalizer as a set of steps: "NFC", "Replace" (" " -> "▁"), "Prepend" ("▁")."""
    if normalizer is None:
        return set()
    kind = normalizer.get("type") if isinstance(normalizer, dict) else None
    if kind == "Sequence":
        return set().union(*(_normalizer(n) for n in _list(normalizer, "normalizers")))
    if kind == "NFC":
        return {"NFC"}
    if kind == "Replace" and normalizer.get("pattern") == {"String": " "} and normalizer.get("content") == SPACE:
        return {"Replace"}
    if kind == "Prepend" and normalizer.get("prepend") == SPACE:
        return {"Prepend"}
    raise TokenizerError(f"normalizer {normalizer!r} is not supported; kvref reads NFC, Replace ' ' -> '▁', "
                         "Prepend '▁' and Sequences of them")


def _pre_tokenizer(pre) -> list[tuple[str, object]]:
    """The pre-tokenizer as steps: ("Split" or "Digits", regex), ("ByteLevel", GPT-2's regex or
    None), ("Metaspace", (space prefix, split words)), ("SpaceMergedWithPrevious", None)."""
    if pre is None:
        return []
    kind = pre.get("type") if isinstance(pre, dict) else None
    if kind == "Sequence":
        return [step for p in _list(pre, "pretokenizers") for step in _pre_tokenizer(p)]
    if kind == "Split" and pre.get("behavior") == "Isolated" and not pre.get("invert"):
        pattern = pre.get("pattern") if isinstance(pre.get("pattern"), dict) else {}
        if isinstance(pattern.get("Regex"), str):
            return [("Split", pattern["Regex"])]
        if isinstance(pattern.get("String"), str):
            return [("Split", regex.escape(pattern["String"]))]
    if kind == "Split" and pre.get("behavior") == "MergedWithPrevious" and pre.get("pattern") == {"String": " "}:
        return [("SpaceMergedWithPrevious", None)]
    if kind == "Digits":
        return [("Digits", r"\p{N}" if pre.get("individual_digits") else r"\p{N}+")]
    if kind == "ByteLevel":
        if pre.get("add_prefix_space"):
            raise TokenizerError("ByteLevel add_prefix_space = true is not supported")
        return [("ByteLevel", GPT2_REGEX if pre.get("use_regex", True) else None)]
    if kind == "Metaspace":
        return [("Metaspace", _metaspace(pre))]
    raise TokenizerError(f"pre-tokenizer {pre!r} is not supported; kvref reads Split (Isolated), Digits, "
                         "ByteLevel, Metaspace and Sequences of them")


def _metaspace(pre: dict) -> tuple[str, bool]:
    if pre.get("replacement", SPACE) != SPACE:
        raise TokenizerError(f"Metaspace replacement {pre['replacement']!r} is not supported; expected '▁'")
    scheme = pre.get("prepend_scheme")
    if scheme is None:  # tokenizer.json files older than prepend_scheme
        scheme = "always" if pre.get("add_prefix_space", True) else "never"
    if scheme not in ("always", "first", "never"):
        raise TokenizerError(f"Metaspace prepend_scheme {scheme!r} should be always, first or never")
    return scheme, bool(pre.get("split", True))


def _decoder_types(decoder, supported: set[str]) -> set[str]:
    """The decoder's component types, each one of `supported`, with the options kvref decodes by."""
    if decoder is None:
        raise TokenizerError("tokenizer.json has no decoder")
    kind = decoder.get("type") if isinstance(decoder, dict) else None
    if kind == "Sequence":
        return set().union(*(_decoder_types(d, supported) for d in _list(decoder, "decoders")))
    fixed = {"Replace": {"pattern": {"String": SPACE}, "content": " "},
             "Strip": {"content": " ", "start": 1, "stop": 0}}
    if kind not in supported or any(decoder.get(k) != v for k, v in fixed.get(kind, {}).items()):
        raise TokenizerError(f"decoder {decoder!r} is not supported; expected {sorted(supported)}")
    return {kind}


def _check_added_normalization(spec: dict, normalizer: set[str]) -> None:
    """HF matches a `normalized` added token in normalized text; kvref splits added tokens out of the
    text as written, which is the same only when there is no normalizer."""
    for added in spec.get("added_tokens") or []:
        if added.get("normalized") and normalizer:
            raise TokenizerError(f"added token {added['content']!r} is matched after normalization "
                                 "(normalized = true), which kvref does not support with a normalizer")


def _merge_pair(merge, rank: int) -> tuple[str, str]:
    """A merge as a "left right" string (HF splits at the one space) or a [left, right] pair."""
    if isinstance(merge, str):
        parts = merge.split(" ")
    elif isinstance(merge, list) and all(isinstance(p, str) for p in merge):
        parts = merge
    else:
        parts = []
    if len(parts) != 2:
        raise TokenizerError(f"merge {rank} {merge!r} should be 'left right' or [left, right]")
    return parts[0], parts[1]


# ---- special tokens, templates, end of generation ------------------------------------------------------

def _post_processor(post, ids: dict[str, int]) -> tuple[bool, bool, dict[str, int]]:
    """(adds BOS, adds EOS, {"bos"/"eos": id}) from a TemplateProcessing's single-sequence template."""
    if post is not None and not isinstance(post, dict):
        raise TokenizerError(f"tokenizer.json post_processor should be an object, got {type(post).__name__}")
    if post is None or post.get("type") in ("ByteLevel",):
        return False, False, {}
    if post.get("type") == "Sequence":
        found = [_post_processor(p, ids) for p in _list(post, "processors")]
        return any(f[0] for f in found), any(f[1] for f in found), {k: v for f in found for k, v in f[2].items()}
    if post.get("type") != "TemplateProcessing":
        raise TokenizerError(f"post_processor {post.get('type')!r} is not supported; expected TemplateProcessing "
                             "or ByteLevel")
    single = _list(post, "single")
    if not all(isinstance(item, dict) and isinstance(item.get("SpecialToken", {}), dict) for item in single):
        raise TokenizerError("post_processor.single must be a list of {\"Sequence\": ...} and "
                             "{\"SpecialToken\": {\"id\": ...}} objects")
    at = next((k for k, item in enumerate(single) if "Sequence" in item), None)
    if at is None:
        raise TokenizerError("post_processor.single has no Sequence")
    names = [item.get("SpecialToken", {}).get("id") for item in single]
    before, after = [n for n in names[:at] if n], [n for n in names[at + 1:] if n]
    for name in before + after:
        if name not in ids:
            raise TokenizerError(f"post_processor special token {name!r} is not in the vocabulary")
    found = {**({"bos": ids[before[0]]} if before else {}), **({"eos": ids[after[-1]]} if after else {})}
    return bool(before), bool(after), found


def _special_id(config: dict, key: str, ids: dict[str, int], default: int | None) -> int | None:
    """tokenizer_config.json's bos_token / eos_token (a string or {"content": ...}) as an id."""
    value = config.get(key)
    if isinstance(value, dict):
        value = value.get("content")
    if value is None:
        return default
    if not isinstance(value, str) or value not in ids:
        raise TokenizerError(f"tokenizer_config.json {key} {value!r} is not a token of tokenizer.json")
    return ids[value]


def _flag(config: dict, key: str, default: bool) -> bool:
    value = config.get(key, default)
    if not isinstance(value, bool):
        raise TokenizerError(f"tokenizer_config.json {key} should be true or false, got {value!r}")
    return value


def _generation_eos_ids(generation: dict) -> list[int]:
    value = generation.get("eos_token_id", [])
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise TokenizerError(f"generation_config.json eos_token_id should be an int or a list of ints, got {value!r}")
    return values


def chat_template(directory) -> str | None:
    """chat_template.jinja (recent transformers write it) or tokenizer_config.json's chat_template (a
    string, or a list of {name, template} of which "default" is the chat template)."""
    path = Path(directory) / "chat_template.jinja"
    if path.is_file():
        return path.read_text(encoding="utf-8")
    template = _json_object(Path(directory) / "tokenizer_config.json", missing_ok=True).get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise TokenizerError(f"tokenizer_config.json chat_template should be a string, got {type(template).__name__}")
    return template


# ---- JSON ----------------------------------------------------------------------------------------------

def _json_object(path: Path, missing_ok: bool = False) -> dict:
    try:
        value = read_json_file(path, "file", TokenizerError)
    except FileNotFoundError:
        if missing_ok:
            return {}
        raise TokenizerError(f"{path} is missing") from None
    if not isinstance(value, dict):
        raise TokenizerError(f"{path} should hold a JSON object")
    return value


def _object(parent: dict, key: str, where: str = "") -> dict:
    value = parent.get(key)
    if not isinstance(value, dict):
        raise TokenizerError(f"tokenizer.json {where}{key} should be an object, got {type(value).__name__}")
    return value


def _list(parent: dict, key: str, where: str = "") -> list:
    value = parent.get(key, [])
    if not isinstance(value, list):
        raise TokenizerError(f"tokenizer.json {where}{key} should be a list, got {type(value).__name__}")
    return value
