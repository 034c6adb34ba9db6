"""Write the seed corpus of every fuzz target into tests/fuzz/corpus/ (checked in; run again only to
change it): small valid inputs that reach deep into each reader, and a few known-hostile ones.

    python -m tests.fuzz.make_corpus
"""

from __future__ import annotations

import json
import struct
import tempfile
from pathlib import Path

import numpy as np

import kvref
from kvref.formats.gguf import ValueType as V

from ..gguf_writer import CHATML, tiny_model
from .targets import CACHE_CONFIG, CORPUS

HF_CONFIG = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 8, "num_attention_heads": 2,
             "num_key_value_heads": 1, "intermediate_size": 16, "vocab_size": 32, "max_position_embeddings": 64,
             "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True}
# a Llama 3 style template (a header per turn, a default system line, raise_exception on a bad role)
LLAMA3 = ("{{ bos_token }}{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
          "{{ raise_exception('bad role ' ~ m['role']) }}{% endif %}<|start_header_id|>{{ m['role'] }}"
          "<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
          "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
# a Gemma style template: a namespace, loop.first, string concatenation and a macro
GEMMA = ("{% set ns = namespace(system='') %}{% macro turn(role, text) %}<start_of_turn>{{ role }}\n{{ text }}"
         "<end_of_turn>\n{% endmacro %}{% for m in messages %}{% if m['role'] == 'system' %}"
         "{% set ns.system = m['content'] ~ '\n\n' %}{% else %}{{ turn('model' if m['role'] == 'assistant' "
         "else 'user', (ns.system if loop.index0 == 1 else '') ~ m['content']) }}{% endif %}{% endfor %}"
         "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
TOOLS = ("{%- for m in messages %}{{- '<|im_start|>' + m.role + '\n' }}{%- if m.content is string %}"
         "{{- m.content }}{%- endif %}{{- '<|im_end|>\n' }}{%- endfor %}{{ messages | tojson(indent=2) }}"
         "{{ messages | map(attribute='role') | join(', ') }}{{ '%-8s|' % 'x' }}{{ range(3) | list }}")
HOSTILE = ["{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
           "{{ 10 ** (10**7) }}", "{{ ''.__class__.__mro__ }}"]


def gguf_corpus():
    return {
        "tiny.gguf": tiny_model(),
        "one-layer-linear-rope.gguf": tiny_model(n_layers=1, metadata={
            "llama.rope.scaling.type": (V.STRING, "linear"), "llama.rope.scaling.factor": (V.FLOAT32, 2.0),
            "general.alignment": (V.UINT32, 64)}),
        "no-template-no-vocab-size.gguf": tiny_model(n_heads=4, n_kv_heads=4, drop=[
            "tokenizer.chat_template", "llama.vocab_size", "llama.attention.head_count_kv"]),
    }


def safetensors_bytes(tensors: dict) -> bytes:
    header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name, array in tensors.items():
        dtype = {"float32": "F32", "float16": "F16"}[array.dtype.name]
        blob = array.astype(array.dtype.newbyteorder("<")).tobytes()
        header[name] = {"dtype": dtype, "shape": list(array.shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + b"".join(blobs)


def safetensors_corpus():
    c = HF_CONFIG
    rng = np.random.default_rng(0)
    E, F, D = c["hidden_size"], c["intermediate_size"], c["hidden_size"] // c["num_attention_heads"]
    shapes = {"model.embed_tokens.weight": (c["vocab_size"], E), "model.norm.weight": (E,)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (E,), p + "post_attention_layernorm.weight": (E,),
                       p + "self_attn.q_proj.weight": (E, E), p + "self_attn.k_proj.weight": (D, E),
                       p + "self_attn.v_proj.weight": (D, E), p + "self_attn.o_proj.weight": (E, E),
                       p + "mlp.gate_proj.weight": (F, E), p + "mlp.up_proj.weight": (F, E),
                       p + "mlp.down_proj.weight": (E, F)})
    tensors = {name: rng.normal(0, 0.3, shape).astype(np.float16 if "mlp" in name else np.float32)
               for name, shape in shapes.items()}
    return {"model.safetensors": safetensors_bytes(tensors), "config.json": json.dumps(HF_CONFIG).encode()}


def cache_corpus():
    model = kvref.Model.random(CACHE_CONFIG, seed=3, backend="numpy")
    layouts = {"contiguous": {"capacity": 16}, "int8": {"kv_dtype": "int8", "group_size": 4, "capacity": 16},
               "paged": {"layout": "paged", "block_size": 4, "prefix_reuse": True},
               "window": {"layout": "window", "window": 4, "sinks": 1},
               "bf16-f16": {"k_dtype": "bfloat16", "v_dtype": "float16", "capacity": 16}}
    files = {}
    with tempfile.TemporaryDirectory() as scratch:
        for name, options in layouts.items():
            cache = model.new_cache(**options)
            model.forward([1, 2, 3, 4, 5, 6], cache)
            path = Path(scratch) / f"{name}.kvc"
            cache.save(path)
            files[f"{name}.kvc-body"] = path.read_bytes()[:-32]  # the target appends the sha256
    return files


def tokenizer_corpus():
    texts = ["Hello world", "<|im_start|>user\nthe thing<|im_end|>", "in the  inn\n\n\tthe", "naïve 中文 😀 ½",
             "'s 'll 123 4.5 the\r\n"]
    return {f"text-{i}": bytes([i % 4]) + t.encode() for i, t in enumerate(texts)}


def chat_corpus():
    templates = {"chatml": CHATML, "llama3": LLAMA3, "gemma": GEMMA, "tools": TOOLS}
    templates.update({f"hostile-{i}": t for i, t in enumerate(HOSTILE)})
    return {name: t.encode() for name, t in templates.items()}


def main():
    for target, files in {"gguf": gguf_corpus(), "safetensors": safetensors_corpus(), "cache": cache_corpus(),
                          "tokenizer": tokenizer_corpus(), "chat": chat_corpus()}.items():
        folder = CORPUS / target
        folder.mkdir(parents=True, exist_ok=True)
        for name, data in files.items():
            (folder / name).write_bytes(data)
        print(f"{folder}: {len(files)} files, {sum(map(len, files.values())):,} bytes")


if __name__ == "__main__":
    main()
