"""The platform a computation is being traced for."""
import jax


def target_platform() -> str:
    """``"cpu"``, ``"tpu"``, ``"gpu"``, ...: the default device's platform (``jax.default_device(...)``,
    e.g. a TPU or GPU compiled for ahead of time from a CPU host), else the default backend's. Code
    that picks a kernel (interpret mode or not, a C++ CPU kernel or not) asks this, not
    ``jax.default_backend()``, so that a deviceless compile for a TPU takes the TPU's path."""
    device = jax.config.jax_default_device
    if device is not None and not isinstance(device, str):
        platform = device.platform
    else:
        platform = jax.default_backend()
    return "gpu" if platform in ("cuda", "rocm") else platform
