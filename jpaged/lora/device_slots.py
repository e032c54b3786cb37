"""Writing adapters into the device slots of the model's LoRA stacks (`jpaged.models.lora`), in place."""
import jax
import numpy as np

from jpaged.sharding import key_path_names


def _set_rows(stacks, slot, rows):
    return [stack.at[slot].set(row) for stack, row in zip(stacks, rows)]


class DeviceSlotWriter:
    """Sets one slot of every LoRA stack of a model state with one jitted call: the stacks are
    donated, so each row is updated in its buffer (no copy of a stack), and the function is
    compiled once for the model's stack shapes (the slot is a traced scalar).

    ``state``: the runner's model state (leaves in `jax.tree.leaves` order). A stack leaf's path
    ends ``(layer index, ..., "lora", "projections", name, "a" | "b")``."""

    def __init__(self, state):
        flat, _ = jax.tree_util.tree_flatten_with_path(state)
        self.indices, self.keys = [], []  # the stacks' positions among the leaves; (layer, name, 0 | 1)
        for i, (key_path, leaf) in enumerate(flat):
            names = key_path_names(key_path)
            strings = [n for n in names if isinstance(n, str)]
            if "lora" in strings and strings[-1] in ("a", "b"):
                layer = next(n for n in names if isinstance(n, int))
                self.indices.append(i)
                self.keys.append((layer, strings[-2], 0 if strings[-1] == "a" else 1))
        stacks = [flat[i][1] for i in self.indices]
        self.row_shapes = [(s.shape[1:], s.dtype) for s in stacks]
        self._set = jax.jit(_set_rows, donate_argnums=(0,), out_shardings=[s.sharding for s in stacks])

    def prepare(self, leaves: list) -> None:
        """Commits the stacks among ``leaves`` to their shardings (a new stack is left uncommitted
        on the default device; the written ones are committed, and jit compiles each kind apart),
        then writes slot 0's zeros: the write function is compiled here, once."""
        for i in self.indices:
            leaves[i] = jax.device_put(leaves[i], leaves[i].sharding)
        self.write(leaves, 0, None)

    def rows(self, adapter) -> list[np.ndarray]:
        """One slot's rows of every stack for ``adapter`` (its ``weights`` {(layer, name): (A, B)},
        already transposed, padded and scaled); zeros where it targets nothing (None: all zeros)."""
        weights = {} if adapter is None else adapter.weights
        out = []
        for (layer, name, side), (shape, dtype) in zip(self.keys, self.row_shapes):
            pair = weights.get((layer, name))
            out.append(np.zeros(shape, dtype) if pair is None else np.asarray(pair[side], dtype))
        return out

    def write(self, leaves: list, slot: int, adapter) -> dict:
        """Writes ``adapter`` (None: zeros) into ``slot``; ``leaves``: the state's current leaves,
        whose stacks are donated. Returns {old stack's id: new stack} for every stack replaced."""
        stacks = [leaves[i] for i in self.indices]
        new = self._set(stacks, np.int32(slot), self.rows(adapter))
        for i, array in zip(self.indices, new):
            leaves[i] = array
        return {id(old): array for old, array in zip(stacks, new)}
