"""Weight file formats (GGUF) and the block layouts of their tensor types."""
