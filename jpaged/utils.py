"""Small helpers shared by the host-side engine."""
import ctypes


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
