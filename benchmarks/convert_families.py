"""The tiny transformers models of tests/test_families.py, converted to GGUF by llama.cpp's own converter,
for the conformance tool's llama.cpp engine (docs/conformance.md).

    python benchmarks/convert_families.py LLAMA_CPP_DIR OUT_DIR [FAMILY ...]
    PYTHONPATH=. /work/llama-venv/bin/python -m kvref conformance llama-cpp-python -m OUT_DIR/FAMILY.gguf

LLAMA_CPP_DIR is vendor/llama.cpp of llama-cpp-python's source package (`pip download --no-deps
--no-binary :all: llama-cpp-python==0.3.36`): convert_hf_to_gguf.py, conversion/ and gguf-py/. It runs in
this process, so this Python needs torch and transformers (kvref's test venv).

Each model is saved with `save_pretrained` beside a small byte-level BPE tokenizer (tests/test_tokenizer_hf.py's
Qwen-style one, so that the suite's texts encode), then converted to float32 GGUF (`--outtype f32`). Three
things are changed in the converter, all about the vocabulary and none about what is compared: every family
takes its vocabulary from that tokenizer.json (`_set_vocab_gpt2`; Gemma 2 and Phi-3 would want a
SentencePiece tokenizer.model), the pre-tokenizer is named `qwen2` (the converter knows tokenizers by the
hash of a test encoding, which a trained toy vocabulary has not), and the model name is neutral (llama.cpp
looks up Phi-3's `</s>` in any file whose general.name says "phi3"). The weights, keys and tensor layout
are the converter's. Each file is checked against transformers on the same model (kvref's logits on the
GGUF, float32) and the largest difference printed, so a file the converter wrote differently from the
checkpoint shows before any engine is compared on it.

gpt-oss converts from float experts (released checkpoints hold MXFP4 blocks, which the converter repacks
as they are); `gpt-oss-mxfp4` is the converted file with its expert tensors requantized to MXFP4 blocks, which
holds the same values (the experts were rounded to MXFP4 values first), as a released model's file does.
"""

from __future__ import annotations

import json
import shutil
import sys
import warnings
from pathlib import Path

import numpy as np

CONTEXT = 256  # positions: the quick suite's prompts and greedy tokens (64 + 8) fit
# every family of tests/test_families.py that a GGUF holds; gpt-oss-mxfp4 is made from gpt_oss's file, after it
FAMILIES = ("gemma2", "phi3", "phi3-long", "smollm3", "gpt_oss", "gpt-oss-mxfp4", "qwen2", "qwen3", "qwen3_moe",
            "mixtral", "mistral", "deepseek_v2", "deepseek_v3", "gemma3", "llama")


def tokenizer_files():
    """A Qwen-style byte-level BPE's tokenizer files (tests/test_tokenizer_hf.py) and its vocabulary size."""
    from tests.test_tokenizer_hf import qwen_style

    _, hf, _, directory = qwen_style()
    return directory, hf.get_vocab_size(with_added_tokens=True)


def model(family, vocab_size):
    """tests/test_families.py's model of `family` with this vocabulary and context, and what GGUF can express
    (GGUF_EXPRESSIBLE), so that the converted file is the checkpoint's model."""
    from tests.test_families import FAMILIES as MODELS
    from tests.test_families import GGUF_EXPRESSIBLE, hf_model, round_experts_to_mxfp4

    changes = dict(GGUF_EXPRESSIBLE.get(family, {}), vocab_size=vocab_size, max_position_embeddings=CONTEXT)
    if family == "deepseek_v2":  # llama.cpp reads a deepseek2 file without q_lora_rank only at V2-Lite's size;
        changes.update(q_lora_rank=12, n_group=1)  # the converter writes n_group with greedy routing too
    if family == "deepseek_v3":  # as released config.json files say it (transformers' config leaves them out)
        changes.update(scoring_func="sigmoid", topk_method="noaux_tc")
    if family == "phi3":  # the short factors: the original context is the whole context
        rope = dict(MODELS["phi3"][1]["rope_parameters"], original_max_position_embeddings=CONTEXT)
        changes.update(rope_parameters=rope, original_max_position_embeddings=CONTEXT)
    if family.startswith("gpt"):  # ggml always truncates YaRN; widths of whole MXFP4 blocks
        rope = dict(MODELS["gpt_oss"][1]["rope_parameters"], truncate=True)
        hf = hf_model("gpt_oss", seed=4, hidden_size=64, intermediate_size=32, rope_parameters=rope, **changes)
        round_experts_to_mxfp4(hf)
        return hf
    return hf_model(family, seed=4, **changes)


def convert(llama_cpp: Path, checkpoint: Path, out: Path):
    """llama.cpp's convert_hf_to_gguf.py on checkpoint, in this process, with the tokenizer changes above."""
    if str(llama_cpp) not in sys.path:
        sys.path[:0] = [str(llama_cpp), str(llama_cpp / "gguf-py")]
    import convert_hf_to_gguf
    from conversion.base import TextModel

    def with_gpt2_vocab(name, mmproj=False):
        cls = get_model_class(name, mmproj)
        cls.set_vocab = TextModel._set_vocab_gpt2
        return cls

    get_model_class = convert_hf_to_gguf.get_model_class
    TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
    convert_hf_to_gguf.get_model_class = with_gpt2_vocab
    argv = sys.argv
    # a general.name with "phi3" in it makes llama.cpp look up Phi-3's "</s>" token, which this vocabulary lacks
    sys.argv = ["convert_hf_to_gguf.py", str(checkpoint), "--outtype", "f32", "--outfile", str(out),
                "--model-name", "kvref tiny model"]
    try:
        convert_hf_to_gguf.main()
    finally:
        sys.argv, convert_hf_to_gguf.get_model_class = argv, get_model_class


def mxfp4_experts(source: Path, out: Path):
    """source rewritten with its ffn_*_exps.weight tensors as MXFP4 blocks (every key and other tensor as is)."""
    import gguf

    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(out, reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if not name.startswith("GGUF.") and name != "general.architecture":
            writer.add_key_value(name, field.contents(), field.types[0],
                                 sub_type=field.types[-1] if len(field.types) > 1 else None)
    for t in reader.tensors:
        data = np.ascontiguousarray(t.data)
        if t.name.endswith("_exps.weight"):  # [X, N, K], blocks of 32 along K
            writer.add_tensor(t.name, gguf.quants.quantize(data, gguf.GGMLQuantizationType.MXFP4),
                              raw_dtype=gguf.GGMLQuantizationType.MXFP4)
        else:
            writer.add_tensor(t.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def check_against_transformers(hf, path) -> float:
    """max |kvref on the GGUF - transformers on the checkpoint| over a 40-position prompt, float32."""
    import torch

    import kvref

    ids = [int(t) for t in np.random.default_rng(0).integers(0, hf.config.vocab_size, 40)]
    with torch.no_grad():
        want = hf.to(torch.float32)(torch.tensor([ids])).logits[0].numpy()
    return float(np.abs(kvref.load(path, backend="numpy").forward(ids, all_logits=True) - want).max())


def main(llama_cpp, out, families):
    warnings.filterwarnings("ignore")
    tokenizer, vocab_size = tokenizer_files()
    out.mkdir(parents=True, exist_ok=True)
    for family in families:
        hf = model(family, vocab_size)
        path = out / f"{family}.gguf"
        if family == "gpt-oss-mxfp4":
            mxfp4_experts(out / "gpt_oss.gguf", path)
        else:
            checkpoint = out / f"{family}-hf"
            hf.save_pretrained(checkpoint)
            for name in ("tokenizer.json", "generation_config.json"):
                shutil.copy(tokenizer / name, checkpoint / name)
            # the plain fast tokenizer, not the family's class (GemmaTokenizer would add its own special tokens)
            config = json.loads((tokenizer / "tokenizer_config.json").read_text())
            (checkpoint / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class":
                                                                          "PreTrainedTokenizerFast"}))
            convert(llama_cpp, checkpoint, path)
            shutil.rmtree(checkpoint)
        print(f"{path}: {path.stat().st_size / 1024:.0f} KiB, kvref vs transformers max |diff| "
              f"{check_against_transformers(hf, path):.2g}", flush=True)


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:] or FAMILIES)
