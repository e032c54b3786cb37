"""The disk tier: one file per block under ``root/namespace``, kept across restarts.

``namespace`` is a digest of everything that makes a block's bytes mean something (the model's
weights, dtypes, KV layout, block size: `jpaged.core.kv_offload.namespace`), so another model never
sees these files. A file is named by the block's stable id and holds::

    MAGIC | header length (8 bytes, little endian) | JSON header | array bytes | sha256 of all before

It is written to a temporary name and renamed into place, so a reader never sees half a file; a
temporary file left by a killed process is removed at start. A file that fails any check (magic,
checksum, namespace, id, sizes) is a miss: logged once, removed. Least recently used files go first
when ``capacity_bytes`` would be exceeded; a write that fails (a full disk) is a logged miss.
"""
import hashlib
import json
import os
from collections import OrderedDict

import ml_dtypes
import numpy as np

from jpaged.logger import logger

MAGIC = b"JPAGEDKV1\n"
SUFFIX = ".kv"
TEMP_SUFFIX = ".tmp"


def _dtype(name: str) -> np.dtype:
    try:
        return np.dtype(name)
    except TypeError:
        return np.dtype(getattr(ml_dtypes, name))


def encode(namespace: str, stable_id: str, data: tuple[np.ndarray, ...]) -> bytes:
    header = json.dumps({"namespace": namespace, "id": stable_id,
                         "arrays": [[a.dtype.name, list(a.shape)] for a in data]}).encode()
    body = MAGIC + len(header).to_bytes(8, "little") + header + b"".join(np.ascontiguousarray(a).tobytes()
                                                                         for a in data)
    return body + hashlib.sha256(body).digest()


def decode(blob: bytes, namespace: str, stable_id: str) -> tuple[np.ndarray, ...]:
    """The arrays of a file's bytes; ValueError saying what is wrong with them."""
    if len(blob) < len(MAGIC) + 8 + 32 or not blob.startswith(MAGIC):
        raise ValueError("not a jpaged KV block file (or truncated)")
    body, digest = blob[:-32], blob[-32:]
    if hashlib.sha256(body).digest() != digest:
        raise ValueError("checksum mismatch (truncated or corrupt)")
    start = len(MAGIC) + 8
    header_len = int.from_bytes(body[len(MAGIC):start], "little")
    header = json.loads(body[start:start + header_len])
    if header.get("namespace") != namespace or header.get("id") != stable_id:
        raise ValueError("written for another model, layout or block")
    offset, arrays = start + header_len, []
    for name, shape in header["arrays"]:
        dtype = _dtype(name)
        n = int(np.prod(shape)) * dtype.itemsize
        if offset + n > len(body):
            raise ValueError("shorter than its header says")
        arrays.append(np.frombuffer(body, dtype, int(np.prod(shape)), offset).reshape(shape).copy())
        offset += n
    if offset != len(body):
        raise ValueError("longer than its header says")
    return tuple(arrays)


class DiskTier:
    def __init__(self, root: str, namespace: str, capacity_bytes: int):
        self.namespace, self.capacity_bytes = namespace, capacity_bytes
        self.directory = os.path.join(root, namespace)
        self.files: OrderedDict[str, int] = OrderedDict()  # stable id -> bytes, least recently used first
        self.used_bytes = 0
        self._warned: set[str] = set()
        try:
            os.makedirs(self.directory, exist_ok=True)
            self._scan()
        except OSError as error:
            self._warn("open", f"disk tier {self.directory!r} unusable, running without it: {error}")

    def _warn(self, kind: str, message: str) -> None:
        """Logs each kind of trouble once."""
        if kind not in self._warned:
            self._warned.add(kind)
            logger.warning("kv_offload: %s", message)

    def _path(self, stable_id: str) -> str:
        return os.path.join(self.directory, stable_id + SUFFIX)

    def _scan(self) -> None:
        """Indexes the files a previous run left, oldest access first; removes unfinished writes."""
        found = []
        for name in os.listdir(self.directory):
            path = os.path.join(self.directory, name)
            if name.endswith(TEMP_SUFFIX):
                self._remove(path)
                self._warn("temp", f"removed unfinished write(s) in {self.directory!r}")
            elif name.endswith(SUFFIX):
                stat = os.stat(path)
                found.append((stat.st_mtime, name[:-len(SUFFIX)], stat.st_size))
        for _, stable_id, size in sorted(found):
            self.files[stable_id] = size
            self.used_bytes += size
        self._make_room(0)

    def __contains__(self, stable_id: str) -> bool:
        return stable_id in self.files

    def _remove(self, path: str) -> None:
        try:
            os.remove(path)
        except OSError:
            pass

    def _drop(self, stable_id: str) -> None:
        self.used_bytes -= self.files.pop(stable_id, 0)
        self._remove(self._path(stable_id))

    def _make_room(self, nbytes: int) -> None:
        while self.files and self.used_bytes + nbytes > self.capacity_bytes:
            self._drop(next(iter(self.files)))

    def put(self, stable_id: str, data: tuple[np.ndarray, ...]) -> int:
        """Writes a block (no-op when present); returns the bytes written (0: not kept)."""
        if stable_id in self.files:
            self.files.move_to_end(stable_id)
            return 0
        blob = encode(self.namespace, stable_id, data)
        if len(blob) > self.capacity_bytes:
            self._warn("full", f"a block of {len(blob)} bytes exceeds disk_bytes={self.capacity_bytes}")
            return 0
        self._make_room(len(blob))
        path = self._path(stable_id)
        temp = f"{path}.{os.getpid()}{TEMP_SUFFIX}"
        try:
            with open(temp, "wb") as f:
                f.write(blob)
            os.replace(temp, path)
        except OSError as error:  # ENOSPC and friends: the block is simply not kept
            self._remove(temp)
            self._warn("write", f"writing to {self.directory!r} failed, blocks not kept: {error}")
            return 0
        self.files[stable_id] = len(blob)
        self.used_bytes += len(blob)
        return len(blob)

    def get(self, stable_id: str) -> tuple[np.ndarray, ...] | None:
        """The block's arrays, or None (absent, or a bad file: then logged once and removed)."""
        if stable_id not in self.files:
            return None
        path = self._path(stable_id)
        try:
            with open(path, "rb") as f:
                data = decode(f.read(), self.namespace, stable_id)
        except (OSError, ValueError, KeyError, TypeError) as error:
            self._warn("bad", f"ignoring bad block file(s) in {self.directory!r}: {error}")
            self._drop(stable_id)
            return None
        self.files.move_to_end(stable_id)
        try:
            os.utime(path)  # the order a restart reads back
        except OSError:
            pass
        return data
