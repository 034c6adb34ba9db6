"""A minimal GGUF writer for the tests: small valid files, and the pieces to assemble broken ones.

Test-only; the package reads GGUF and never writes it. Dims are given in GGUF order (innermost first).
"""

import struct

from kvref.formats.gguf import ValueType as V

_FORMATS = {V.UINT8: "<B", V.INT8: "<b", V.UINT16: "<H", V.INT16: "<h", V.UINT32: "<I", V.INT32: "<i",
            V.UINT64: "<Q", V.INT64: "<q", V.FLOAT32: "<f", V.FLOAT64: "<d", V.BOOL: "<B"}


def u32(n):
    return struct.pack("<I", n)


def u64(n):
    return struct.pack("<Q", n)


def string(s):
    # str, or bytes taken as they are (to write invalid UTF-8)
    data = s.encode() if isinstance(s, str) else s
    return u64(len(data)) + data


def value(vtype, v):
    """The encoding of one value; an array is given as (item_type, items)."""
    if vtype == V.STRING:
        return string(v)
    if vtype == V.ARRAY:
        item_type, items = v
        return u32(item_type) + u64(len(items)) + b"".join(value(item_type, x) for x in items)
    return struct.pack(_FORMATS[vtype], v)


def kv(key, vtype, v):
    return string(key) + u32(vtype) + value(vtype, v)


def header(n_tensors, n_kv, version=3, magic=b"GGUF"):
    return magic + u32(version) + u64(n_tensors) + u64(n_kv)


def tensor_info(name, dims, type_id, offset):
    return string(name) + u32(len(dims)) + b"".join(u64(d) for d in dims) + u32(type_id) + u64(offset)


def assemble(kvs, infos, data=b"", alignment=32, version=3, n_kv=None, n_tensors=None):
    """A file from encoded pieces: header, metadata entries, tensor infos, padding, tensor data.

    The counts default to the number of pieces; pass them to lie about it.
    """
    head = header(len(infos) if n_tensors is None else n_tensors, len(kvs) if n_kv is None else n_kv, version)
    head += b"".join(kvs) + b"".join(infos)
    return head + bytes(-len(head) % alignment) + data


def gguf_bytes(metadata, tensors, version=3):
    """A valid file. metadata: {key: (vtype, value)}; tensors: {name: (ggml_type, dims, data bytes)}.

    Tensors are laid out in order, each at the next aligned offset; nothing follows the last one, so
    cutting any byte off the end breaks the file.
    """
    alignment = metadata.get("general.alignment", (V.UINT32, 32))[1]
    if not isinstance(alignment, int) or not 0 < alignment <= 4096:  # a hostile value: lay out as the default
        alignment = 32
    infos, data = [], bytearray()
    for name, (ggml_type, dims, tensor_bytes) in tensors.items():
        data += bytes(-len(data) % alignment)
        infos.append(tensor_info(name, dims, ggml_type, len(data)))
        data += tensor_bytes
    kvs = [kv(key, vtype, v) for key, (vtype, v) in metadata.items()]
    return assemble(kvs, infos, bytes(data), alignment, version)


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tiny_model(n_layers=2, d_model=8, n_heads=2, n_kv_heads=1, d_ff=16, context=64, seed=0, metadata=None,
               drop=()):
    """A complete, tiny llama GGUF file (F32 weights, a byte-level BPE tokenizer of the 256 byte
    characters, a few merges and the ChatML tokens, a ChatML chat template): what kvref.load reads.
    metadata: {key: (vtype, value)} entries that replace or add to the defaults; drop: keys to leave out.
    """
    import numpy as np

    from kvref.text.bytelevel import BYTE_TO_CHAR

    merged = ["Ġt", "he", "Ġthe", "in"]
    tokens = list(BYTE_TO_CHAR) + merged + ["<|im_start|>", "<|im_end|>"]
    types = [1] * (len(tokens) - 2) + [3, 3]
    meta = {
        "general.architecture": (V.STRING, "llama"),
        "llama.block_count": (V.UINT32, n_layers),
        "llama.context_length": (V.UINT32, context),
        "llama.embedding_length": (V.UINT32, d_model),
        "llama.feed_forward_length": (V.UINT32, d_ff),
        "llama.attention.head_count": (V.UINT32, n_heads),
        "llama.attention.head_count_kv": (V.UINT32, n_kv_heads),
        "llama.attention.layer_norm_rms_epsilon": (V.FLOAT32, 1e-5),
        "llama.rope.freq_base": (V.FLOAT32, 10000.0),
        "llama.vocab_size": (V.UINT32, len(tokens)),
        "tokenizer.ggml.model": (V.STRING, "gpt2"),
        "tokenizer.ggml.pre": (V.STRING, "gpt-2"),
        "tokenizer.ggml.tokens": (V.ARRAY, (V.STRING, tokens)),
        "tokenizer.ggml.token_type": (V.ARRAY, (V.INT32, types)),
        "tokenizer.ggml.merges": (V.ARRAY, (V.STRING, ["Ġ t", "h e", "Ġt he", "i n"])),
        "tokenizer.ggml.bos_token_id": (V.UINT32, len(tokens) - 2),
        "tokenizer.ggml.eos_token_id": (V.UINT32, len(tokens) - 1),
        "tokenizer.chat_template": (V.STRING, CHATML),
    }
    meta.update(metadata or {})
    for key in drop:
        meta.pop(key, None)
    rng = np.random.default_rng(seed)
    head_dim = d_model // n_heads
    shapes = {"token_embd.weight": (len(tokens), d_model), "output_norm.weight": (d_model,)}
    for i in range(n_layers):
        shapes.update({
            f"blk.{i}.attn_norm.weight": (d_model,), f"blk.{i}.ffn_norm.weight": (d_model,),
            f"blk.{i}.attn_q.weight": (n_heads * head_dim, d_model),
            f"blk.{i}.attn_k.weight": (n_kv_heads * head_dim, d_model),
            f"blk.{i}.attn_v.weight": (n_kv_heads * head_dim, d_model),
            f"blk.{i}.attn_output.weight": (d_model, n_heads * head_dim),
            f"blk.{i}.ffn_gate.weight": (d_ff, d_model), f"blk.{i}.ffn_up.weight": (d_ff, d_model),
            f"blk.{i}.ffn_down.weight": (d_model, d_ff)})
    tensors = {}
    for name, shape in shapes.items():
        values = np.ones(shape) if name.endswith("norm.weight") else rng.normal(0, 0.3, shape)
        tensors[name] = (0, list(reversed(shape)), values.astype("<f4").tobytes())  # type 0: F32
    return gguf_bytes(meta, tensors)
