"""Small helpers shared by the host-side engine."""
import ctypes
import json

import numpy as np

# the integer helpers are defined once, with the kernels (which import nothing of jpaged)
from pallas_kernels.shapes import cdiv, next_power_of_two

__all__ = ["bucket", "cdiv", "check_text", "invalid_text_path", "next_power_of_two", "pad_rows", "padded_ids",
           "read_json", "release_free_host_memory", "step_bucket"]


def step_bucket(n: int, minimum: int = 1) -> int:
    """The smallest step size >= max(n, minimum): 2, 4, 8, 16, 24, 32, 48, 64, then quarter steps
    up to 256 (80, 96, 112, 128, 160, 192, 224, 256), then 384, 512, 768, ... (powers of two and
    their 1.5x). A step's tokens and rows are padded to these: a large decode batch wastes at most a
    fifth of its work (powers of two alone: up to half), and the prefill sizes stay few."""
    n = max(n, minimum)
    p = next_power_of_two(n)
    if p <= 16:
        return p
    step = p // 8 if 64 < p <= 256 else p // 4  # quarter steps from 64 to 256, else half steps
    return -(-n // step) * step


def bucket(n: int, minimum: int = 1) -> int:
    """The smallest power of two >= max(n, minimum); 0 stays 0 when minimum is 0.

    Host arrays are padded to these sizes so the jitted step sees few distinct shapes."""
    n = max(n, minimum)
    return 0 if n == 0 else next_power_of_two(n)


def padded_ids(values: list[int], minimum: int = 1, fill: int = -1) -> np.ndarray:
    """int32 ids padded with ``fill`` to a power-of-two length (at least ``minimum``)."""
    out = np.full(bucket(len(values), minimum), fill, np.int32)
    out[:len(values)] = values
    return out


def pad_rows(rows: list, num_rows: int, width: int | None = None, fill=-1, dtype=np.int32) -> np.ndarray:
    """``[num_rows, width]`` array of the rows' lists padded with ``fill``; ``width`` defaults to the
    power-of-two bucket of the longest row (0 when every row is empty)."""
    if width is None:
        width = bucket(max(map(len, rows), default=0), 0)
    out = np.full((num_rows, width), fill, dtype)
    for i, r in enumerate(rows):
        if len(r):  # an empty row is all fill already (most rows of most steps' sampling lists)
            out[i, :len(r)] = r
    return out


def release_free_host_memory() -> None:
    """Hands the C heap's free pages back to the OS (glibc's ``malloc_trim``; a no-op elsewhere).

    Loading a checkpoint (dequantizing GGUF tensors, converting dtypes) frees hundreds of MB that
    glibc would otherwise keep in the process: on CPU that is resident memory for nothing.
    """
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def read_json(file: str) -> dict:
    """A JSON object from ``file``; ValueError naming the file when it is not one."""
    try:
        with open(file, encoding="utf-8") as f:
            value = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{file}: expected a JSON object, got {type(value).__name__}")
    return value


def invalid_text_path(value, name: str) -> str | None:
    """Where in ``value`` (a string, or lists and dicts of them, keys included) a string is not valid
    Unicode text, as ``name[1].content``, or None. Such a string holds a lone surrogate (``"\\ud800"``):
    JSON and Python carry it, but no tokenizer, grammar engine or UTF-8 encoder takes it."""
    stack = [(value, name)]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            if not item.isascii():
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError:
                    return path
        elif isinstance(item, dict):
            for k, v in item.items():
                if isinstance(k, str) and invalid_text_path(k, path) is not None:
                    return path
                stack.append((v, f"{path}.{k}" if isinstance(k, str) and k.isidentifier() else f"{path}[{k!r}]"))
        elif isinstance(item, (list, tuple)):
            stack.extend((v, f"{path}[{i}]") for i, v in reversed(list(enumerate(item))))
    return None


def check_text(value, name: str) -> None:
    """ValueError naming the field (``invalid_text_path``) when ``value`` holds a string that is not
    valid Unicode text."""
    path = invalid_text_path(value, name)
    if path is not None:
        raise ValueError(f"{path}: not valid Unicode text (it holds a lone surrogate such as '\\ud800'); "
                         "send UTF-8 text")
