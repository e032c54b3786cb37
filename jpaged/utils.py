"""Small integer helpers shared by the host-side engine."""


def cdiv(a: int, b: int) -> int:
    """Ceiling division."""
    return -(-a // b)


def next_power_of_two(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, n - 1).bit_length()
