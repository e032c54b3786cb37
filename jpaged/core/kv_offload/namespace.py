"""The disk tier's namespace: a digest of everything that gives a block's bytes their meaning.

Weights digest: for a checkpoint on disk, sha256 of its files' relative names, sizes and
modification times (cheap at any size: a re-saved or replaced checkpoint gets a new namespace);
for a model given in memory, sha256 of its parameter bytes. Then the model dtype, the KV page
dtype, the block size, the KV-cache layout (groups, windows, layers per block), KV heads per
device, head dim, the weights quantization and the file format version.
"""
import hashlib
import json
import os

import numpy as np

FORMAT_VERSION = 1


def checkpoint_digest(path: str) -> str:
    """Names, sizes and modification times of the checkpoint's files (a file or a directory)."""
    h = hashlib.sha256()
    root = os.path.abspath(path)
    if os.path.isfile(root):
        files = [root]
    else:
        files = sorted(os.path.join(d, f) for d, _, names in os.walk(root) for f in names)
    for f in files:
        stat = os.stat(f)
        h.update(f"{os.path.relpath(f, os.path.dirname(root))}:{stat.st_size}:{stat.st_mtime_ns}\n".encode())
    return h.hexdigest()


def params_digest(arrays) -> str:
    """The bytes of every parameter array, in order."""
    h = hashlib.sha256()
    for a in arrays:
        a = np.asarray(a)
        h.update(f"{a.dtype.name}{a.shape}".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def namespace(weights_digest: str, **layout) -> str:
    """A directory name for these weights and this KV layout (``layout``: JSON-able values)."""
    text = json.dumps({"version": FORMAT_VERSION, "weights": weights_digest, **layout}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]
