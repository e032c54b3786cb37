"""Small helpers shared by the host-side engine."""
import ctypes
import json


def cdiv(a: int, b: int) -> int:
    """Ceiling division."""
    return -(-a // b)


def next_power_of_two(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, n - 1).bit_length()


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
