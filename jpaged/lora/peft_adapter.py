"""PEFT LoRA adapters read from disk (or given in memory) and checked against the served model,
on the host.

A PEFT directory holds ``adapter_config.json`` (``r``, ``lora_alpha``, ``use_rslora``,
``target_modules``, ``rank_pattern``, ``alpha_pattern``) and ``adapter_model.safetensors``
(``base_model.model.model.layers.{i}.{self_attn|mlp}.{proj}.lora_A.weight`` ``[r, in]`` and
``lora_B.weight`` ``[out, r]``). An adapter given in memory (`peft_adapter_from_memory`: a trainer's
adapter) is the same config as a dict and the same tensors by the same names. Every check runs
here, before any device work, and a failure is a ValueError naming the file (or the in-memory
adapter) and the field.
"""
import json
import os
import re
from dataclasses import dataclass

import numpy as np

from jpaged.models.lora import MLP_MODULES, TARGET_MODULES

_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclass
class LoRAAdapter:
    """An adapter ready for a device slot: per (layer, projection), ``a [in, max_rank]`` and
    ``b [max_rank, out]`` zero-padded to the engine's ``max_lora_rank``, the scale folded into b."""

    name: str
    int_id: int
    path: str
    rank: int                  # the largest rank of its modules
    weights: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def _pattern_value(pattern: dict, module_name: str, default):
    """PEFT's ``rank_pattern`` / ``alpha_pattern`` lookup: a key matches a module whose full name
    ends with it (at a dot)."""
    for key, value in (pattern or {}).items():
        if re.match(rf"(.*\.)?{key}$", module_name):
            return value
    return default


def read_adapter_config(path: str) -> dict:
    if not os.path.isdir(path):
        raise ValueError(f"lora_path: {path!r} is not a directory (a PEFT adapter directory is expected)")
    config_file = os.path.join(path, "adapter_config.json")
    try:
        with open(config_file) as f:
            config = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"lora_path: {config_file} is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{config_file}: not valid JSON ({e})") from None
    check_adapter_config(config, config_file)
    return config


def check_adapter_config(config, where: str) -> None:
    """ValueError (prefixed ``where``) for a PEFT config jpaged cannot serve."""
    if not isinstance(config, dict):
        raise ValueError(f"{where}: expected a JSON object")
    kind = config.get("peft_type", "LORA")
    if kind != "LORA":
        raise ValueError(f"{where}: peft_type={kind!r}, only 'LORA' adapters are supported")
    if config.get("use_dora"):
        raise ValueError(f"{where}: use_dora=True is not supported")
    for field in ("modules_to_save", "layers_to_transform"):
        if config.get(field):
            raise ValueError(f"{where}: {field}={config[field]!r} is not supported")
    if config.get("bias", "none") != "none":
        raise ValueError(f"{where}: bias={config['bias']!r} is not supported (only 'none')")


def _read_tensors(path: str) -> dict[str, np.ndarray]:
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    weights_file = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(weights_file):
        raise ValueError(f"lora_path: {weights_file} is missing")
    try:
        return load_file(weights_file)
    except (SafetensorError, OSError, ValueError) as e:
        raise ValueError(f"{weights_file}: cannot be read ({e})") from None
    except Exception as e:  # noqa: BLE001 -- the safetensors parser raises bare errors on some corruptions
        raise ValueError(f"{weights_file}: cannot be read ({e})") from None


def load_peft_adapter(request, shapes: dict[tuple[int, str], tuple[int, int]], max_rank: int,
                      dtype=np.float32) -> LoRAAdapter:
    """The adapter of ``request`` (a `LoRARequest`) read from its directory, for a model whose
    LoRA-capable projections have these (in, out) ``shapes`` by (layer, name); ValueError when it
    does not fit."""
    path = request.lora_path
    config = read_adapter_config(path)
    return _build_adapter(request, config, _read_tensors(path), shapes, max_rank, dtype,
                          config_file=os.path.join(path, "adapter_config.json"),
                          weights_file=os.path.join(path, "adapter_model.safetensors"))


def peft_adapter_from_memory(request, config: dict, tensors: dict, shapes: dict[tuple[int, str], tuple[int, int]],
                             max_rank: int, dtype=np.float32) -> LoRAAdapter:
    """An adapter given in memory: ``config`` the fields of ``adapter_config.json``, ``tensors``
    ``{PEFT tensor name: array}`` (numpy or JAX, copied to the host); checked as a directory's is."""
    where = f"lora_request {request.lora_name!r} (in memory)"
    check_adapter_config(config, f"{where}: config")
    if not isinstance(tensors, dict):
        raise ValueError(f"{where}: tensors: expected {{PEFT tensor name: array}}, got {type(tensors).__name__}")
    host = {key: np.asarray(value) for key, value in tensors.items()}
    return _build_adapter(request, config, host, shapes, max_rank, dtype,
                          config_file=f"{where}: config", weights_file=f"{where}: tensors")


def _build_adapter(request, config: dict, tensors: dict[str, np.ndarray], shapes, max_rank: int, dtype, *,
                   config_file: str, weights_file: str) -> LoRAAdapter:
    """Checks ``tensors`` against ``config`` and the model's ``shapes`` (errors name ``config_file``
    and ``weights_file``: the files, or the in-memory adapter); transposes, pads and scales them."""
    targets = config.get("target_modules")
    if isinstance(targets, str):
        raise ValueError(f"{config_file}: target_modules as a regular expression ({targets!r}) is not supported; "
                         f"list the modules ({', '.join(TARGET_MODULES)})")
    projections = {name for _, name in shapes}
    for target in targets or []:
        if target not in TARGET_MODULES:
            raise ValueError(f"{config_file}: target_modules has {target!r}; supported: {', '.join(TARGET_MODULES)}")
        if target not in projections:
            why = " (a mixture-of-experts MLP takes no adapter)" if target in MLP_MODULES else ""
            raise ValueError(f"{config_file}: target_modules has {target!r}, which this model lacks{why}")
    r, alpha, rslora = config.get("r", 8), config.get("lora_alpha", 8), bool(config.get("use_rslora", False))
    factors: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise ValueError(f"{weights_file}: tensor {key!r} is not a LoRA factor of a layer's "
                             f"{'/'.join(TARGET_MODULES)} projection")
        layer, _, name, which = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        if (layer, name) not in shapes:
            raise ValueError(f"{weights_file}: tensor {key!r}: the model has no layer {layer} {name} "
                             "that takes an adapter")
        factors.setdefault((layer, name), {})[which] = value
    if not factors:
        raise ValueError(f"{weights_file}: holds no LoRA factors")
    weights, largest = {}, 0
    for (layer, name), pair in sorted(factors.items()):
        module = f"model.layers.{layer}.{'mlp' if name in MLP_MODULES else 'self_attn'}.{name}"
        if set(pair) != {"A", "B"}:
            raise ValueError(f"{weights_file}: {module} has lora_{'A' if 'A' not in pair else 'B'} missing")
        a, b = pair["A"], pair["B"]
        din, dout = shapes[(layer, name)]
        rank = _pattern_value(config.get("rank_pattern"), module, r)
        module_alpha = _pattern_value(config.get("alpha_pattern"), module, alpha)
        if a.shape != (rank, din) or b.shape != (dout, rank):
            raise ValueError(f"{weights_file}: {module}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit "
                             f"the base model's {din} -> {dout} projection with r={rank} (an adapter of another base?)")
        if rank > max_rank:
            raise ValueError(f"{config_file}: r={rank} ({module}) exceeds max_lora_rank={max_rank}")
        if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
            raise ValueError(f"{weights_file}: {module} has non-finite values")
        scale = module_alpha / (rank ** 0.5 if rslora else rank)
        a_pad = np.zeros((din, max_rank), dtype)
        b_pad = np.zeros((max_rank, dout), dtype)
        a_pad[:, :rank] = a.astype(np.float32).T
        b_pad[:rank] = (b.astype(np.float32).T * scale)
        weights[(layer, name)] = (a_pad, b_pad)
        largest = max(largest, rank)
    return LoRAAdapter(request.lora_name, request.lora_int_id, request.lora_path, largest, weights)
