"""Deviceless ahead-of-time compiles of jpaged's kernels for real TPU and GPU targets."""
