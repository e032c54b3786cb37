"""The Pallas kernels under the name of the project's layout: an alias of `jpaged_kernels`' public
kernels and their jnp references (``jpaged_kernels.pallas`` holds the Pallas code)."""

from jpaged_kernels import *  # noqa: F401,F403
from jpaged_kernels import __all__  # noqa: F401
