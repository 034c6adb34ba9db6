"""The readable specification: kernels (ops) and the decoder, in NumPy, no speed tricks."""
