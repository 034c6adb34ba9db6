"""Weight file formats: the GGUF reader and the Llama tensor names (block layouts: kvref.spec.ggml)."""
