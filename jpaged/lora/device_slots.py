"""Writing an adapter into a device slot of the model's LoRA stacks (`jpaged.models.lora`)."""
import jax.numpy as jnp

from jpaged.models.lora import lora_targets


def write_slot(model, slot: int, adapter) -> None:
    """Sets slot ``slot`` of every LoRA stack of ``model`` (an NNX model, merged from the runner's
    state) to ``adapter``'s factors; projections it does not target are zeroed (the slot may have
    held another adapter). ``adapter`` None clears the slot."""
    weights = {} if adapter is None else adapter.weights
    for layer, part, _ in lora_targets(model):
        for name, projection in part.lora.projections.items():
            a, b = projection.a[...], projection.b[...]
            pair = weights.get((layer, name))
            new_a = jnp.zeros(a.shape[1:], a.dtype) if pair is None else jnp.asarray(pair[0], a.dtype)
            new_b = jnp.zeros(b.shape[1:], b.dtype) if pair is None else jnp.asarray(pair[1], b.dtype)
            projection.a.set_value(a.at[slot].set(new_a))
            projection.b.set_value(b.at[slot].set(new_b))
