"""SHA-256 without loading OpenSSL when kvref is imported.

`import hashlib` loads OpenSSL's libcrypto (~3.5 MiB resident), and `kvref run` needs one small
digest only (the model fingerprint a new cache records). `sha256` is CPython's own SHA-256 for such
small inputs (model fingerprints, paged-cache prefix keys): the same digests, without OpenSSL.
Saved cache files, hundreds of MB, take `sha256_bulk`: OpenSSL's, ~6x faster here, imported on
first use.
"""

try:
    from _sha2 import sha256  # CPython 3.12 and later
except ImportError:
    try:
        from _sha256 import sha256  # CPython 3.10 and 3.11
    except ImportError:  # a build without its own SHA-256 modules
        from hashlib import sha256

__all__ = ["sha256", "sha256_bulk"]


def sha256_bulk(data):
    """hashlib.sha256(data): OpenSSL's SHA-256, for large inputs."""
    import hashlib

    return hashlib.sha256(data)
