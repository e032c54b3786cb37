"""Counts the compilations of the jitted step's pieces: one per distinct set of argument shapes."""
import jax
import numpy as np


class CompileCounter:
    def __init__(self):
        self.signatures: set = set()

    def __len__(self) -> int:
        return len(self.signatures)

    @staticmethod
    def signature(name: str, *args) -> tuple:
        """What tells ``name``'s compilations apart: the arguments' structure, shapes and dtypes."""
        leaves, treedef = jax.tree.flatten(args)
        return name, treedef, tuple((np.shape(x), getattr(x, "dtype", type(x))) for x in leaves)

    def note(self, name: str, *args) -> None:
        """Notes the argument shapes ``name`` is called with (one compilation, or one load from the
        persistent compilation cache, per distinct set)."""
        self.signatures.add(self.signature(name, *args))

    def call(self, name: str, fn, *args, num_fixed: int = 0):
        """``fn(*args)``, noting the shapes of the arguments after the first ``num_fixed`` (whose
        shapes never change: parameters, the pool)."""
        self.note(name, *args[num_fixed:])
        return fn(*args)
