"""A Tunix policy's qwix LoRA factors as one jpaged adapter, in PEFT's form. No Tunix or qwix import.

qwix (``qwix.LoraProvider`` + ``qwix.apply_lora_to_model``) gives each weight its rules match two
``nnx.LoRAParam`` beside it on the same module, ``<weight>_lora_a`` and ``<weight>_lora_b``. A holds the
weight's contracting axes then the rank, B the rank then the weight's other axes (qwix
``_parse_einsum_str_for_lora`` / ``_create_lora_layer_shapes``); on Tunix's Llama3 / Qwen2 / Qwen3:

============================================  ===========  ===========  ===========
weight (Tunix path after ``layers.{i}.``)     Tunix shape  qwix A       qwix B
============================================  ===========  ===========  ===========
``attn.{q,k,v}_proj.w`` (``BTD,DNH->BTNH``)   [D, N, H]    [D, r]       [r, N, H]
``attn.o_proj.w`` (``BTNH,NHD->BTD``)         [N, H, D]    [N, H, r]    [r, D]
``mlp.{gate,up,down}_proj.kernel`` (Linear)   [in, out]    [in, r]      [r, out]
============================================  ===========  ===========  ===========

and the module adds ``(x A) B * alpha / rank`` with its rule's ``alpha`` and ``rank`` (qwix
``LoraProvider.einsum`` / ``dot_general``). Flattened row-major, A is ``[in, r]`` and B ``[r, out]`` over
the same ``N*H`` order as the Hugging Face weight `tunix_to_hf` makes (q: ``w.reshape(D, -1).T``,
o: ``w.reshape(-1, D).T``), so PEFT's ``lora_A.weight`` is ``A.T`` ``[r, in]``, ``lora_B.weight`` is
``B.T`` ``[out, r]``, and ``lora_alpha / r`` is qwix's scale. jpaged adapts q/k/v/o/gate/up/down
only: a factor of any other weight (``lm_head``, the embedding) is a ValueError.
"""
import functools
import re

import numpy as np
from flax import nnx

from jpaged.integrations.tunix_params import LAYER_PARAMS, LAYER_PATH, is_lora_factor

_PROJECTIONS = {path: hf.rsplit(".", 1)[0] for path, (hf, how) in LAYER_PARAMS.items() if how in ("dnh", "nhd", "t")}
_OPS = {"w": "einsum", "kernel": "dot_general"}  # the op qwix intercepts for Tunix's Einsum / nnx.Linear weights


def lora_factors(source) -> dict[str, object]:
    """``{dotted Tunix path: array}`` of the LoRA factors of a Tunix model or ``nnx.State``."""
    state = source if isinstance(source, nnx.State) else nnx.state(source, nnx.LoRAParam)
    out = {}
    for path, value in nnx.to_flat_state(state):
        name = ".".join(map(str, path))
        if is_lora_factor(name, value):
            out[name] = value.get_value() if hasattr(value, "get_value") else value
    return out


def qwix_lora_rules(model) -> list | None:
    """The rules of the ``qwix.LoraProvider`` a model was built with, or None when not found.
    ``qwix.apply_lora_to_model`` gives the model a class whose ``__call__`` wraps the provider
    (``functools.partial(_input_transform, provider)`` in its closure): read from there."""
    for attribute in vars(type(model)).values():
        for cell in getattr(attribute, "__closure__", None) or ():
            try:
                content = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if isinstance(content, functools.partial) and content.args:
                rules = getattr(content.args[0], "_rules", None)
                if rules and all(hasattr(r, "module_path") for r in rules):
                    return list(rules)
    return None


def module_rank_alpha(factors: dict, rules: list | None,
                      lora_alpha: float | None = None) -> dict[str, tuple[int, float]]:
    """``{Tunix module path: (rank, alpha)}`` qwix scales each module's delta with (``alpha / rank``):
    the first rule whose ``module_path`` matches the module (``/``-joined, as qwix matches) and whose
    ``op_names`` allow its op; ``lora_alpha`` (rank: the factors') instead, when given."""
    out = {}
    for name, value in factors.items():
        if not name.endswith("_lora_a"):
            continue
        module, weight = name[:-len("_lora_a")].rsplit(".", 1)
        if lora_alpha is not None:
            out[module] = (int(np.shape(value)[-1]), float(lora_alpha))
            continue
        if rules is None:
            raise ValueError("lora_alpha: the rollout actor's qwix LoraProvider was not found (its rules give "
                             "each module's alpha); pass lora_alpha= to JpagedRollout")
        op = _OPS.get(weight, weight)
        rule = next((r for r in rules if re.fullmatch(r.module_path, module.replace(".", "/"))
                     and (not getattr(r, "op_names", ()) or op in r.op_names)), None)
        if rule is None or not hasattr(rule, "rank") or not hasattr(rule, "alpha"):
            raise ValueError(f"params: {name!r}: no qwix LoRA rule matches module {module.replace('.', '/')!r}")
        out[module] = (int(rule.rank), float(rule.alpha))
    return out


def qwix_lora_to_peft(factors: dict, rank_alpha: dict[str, tuple[int, float]]) -> tuple[dict, dict]:
    """``(adapter_config fields, {PEFT tensor name: numpy array})`` of qwix factors
    (``{dotted Tunix path: array}``) with each module's qwix ``(rank, alpha)``."""
    pairs: dict[str, dict[str, np.ndarray]] = {}
    for name, value in factors.items():
        base, side = name[:-len("_lora_a")], name[-1]
        pairs.setdefault(base, {})[side] = np.asarray(value)
    config = {"peft_type": "LORA", "target_modules": set(), "rank_pattern": {}, "alpha_pattern": {}}
    tensors = {}
    for base, pair in sorted(pairs.items()):
        layer = LAYER_PATH.fullmatch(base)
        projection = _PROJECTIONS.get(layer.group(2)) if layer else None
        if projection is None:
            raise ValueError(f"params: LoRA on {base!r}: jpaged serves adapters on the layers' "
                             f"{', '.join(sorted(_PROJECTIONS))} weights only")
        if set(pair) != {"a", "b"}:
            raise ValueError(f"params: {base}_lora_{'a' if 'a' not in pair else 'b'} is missing")
        rank = pair["a"].shape[-1]
        if pair["b"].shape[0] != rank:
            raise ValueError(f"params: {base}: lora_a {pair['a'].shape} and lora_b {pair['b'].shape} differ in rank")
        module = f"model.layers.{layer.group(1)}.{projection}"
        tensors[f"base_model.model.{module}.lora_A.weight"] = pair["a"].reshape(-1, rank).T
        tensors[f"base_model.model.{module}.lora_B.weight"] = pair["b"].reshape(rank, -1).T
        qwix_rank, alpha = rank_alpha[base.rsplit(".", 1)[0]]
        config["target_modules"].add(projection.rsplit(".", 1)[1])
        config["rank_pattern"][re.escape(module)] = rank
        # PEFT scales by alpha / r (r: the factors' rank), qwix by alpha / its rule's rank
        config["alpha_pattern"][re.escape(module)] = alpha if rank == qwix_rank else alpha * rank / qwix_rank
    ranks, alphas = set(config["rank_pattern"].values()), set(config["alpha_pattern"].values())
    config["target_modules"] = sorted(config["target_modules"])
    config["r"] = max(ranks, default=1)
    if len(ranks) == 1 and len(alphas) == 1:  # one rule for all: no patterns
        config["lora_alpha"] = alphas.pop()
        config["rank_pattern"], config["alpha_pattern"] = {}, {}
    return config, tensors
