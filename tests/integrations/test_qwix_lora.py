"""qwix LoRA factors of a Tunix policy as a jpaged adapter (`jpaged.integrations.qwix_lora`), in the
main environment: no Tunix or qwix needed.

The oracle is qwix's own arithmetic, written out here: each factor shaped as qwix makes it for the
Tunix weight, and the delta as qwix's ``LoraProvider.einsum`` / ``dot_general`` computes it
(``einsum(lhs, A, B) * alpha / rank``, with the einsum string qwix derives from the weight's). The
adapter jpaged builds from the PEFT form (`peft_adapter_from_memory`, the engine's own path) must
give the same delta on the Hugging Face-layout input `tunix_to_hf` feeds the engine.
"""
import dataclasses

import numpy as np
import pytest

from jpaged.integrations.qwix_lora import module_rank_alpha, qwix_lora_to_peft
from jpaged.lora.peft_adapter import peft_adapter_from_memory
from jpaged.lora.request import LoRARequest

D, N, K, H, F = 8, 4, 2, 3, 10  # hidden, query heads, kv heads, head dim, MLP width
B, T = 2, 3

# Tunix weight -> (jpaged projection, qwix's LoRA einsum for it, A's shape and B's shape without the
# rank, the lhs shape after (B, T)); A = contracting axes + r, B = r + the other axes (qwix
# `_parse_einsum_str_for_lora`, `_create_lora_layer_shapes`)
WEIGHTS = {
    "attn.q_proj.w": ("q_proj", "BTD,Dr,rNH->BTNH", (D,), (N, H), (D,)),
    "attn.k_proj.w": ("k_proj", "BSD,Dr,rKH->BSKH", (D,), (K, H), (D,)),
    "attn.v_proj.w": ("v_proj", "BSD,Dr,rKH->BSKH", (D,), (K, H), (D,)),
    "attn.o_proj.w": ("o_proj", "BTNH,NHr,rD->BTD", (N, H), (D,), (N, H)),
    "mlp.gate_proj.kernel": ("gate_proj", "BTD,Dr,rF->BTF", (D,), (F,), (D,)),
    "mlp.up_proj.kernel": ("up_proj", "BTD,Dr,rF->BTF", (D,), (F,), (D,)),
    "mlp.down_proj.kernel": ("down_proj", "BTF,Fr,rD->BTD", (F,), (D,), (F,)),
}


@dataclasses.dataclass(frozen=True)
class Rule:  # the fields of qwix's LoraRule that decide a module's scale
    module_path: str
    rank: int
    alpha: float
    op_names: tuple = ()


RULES = [Rule(".*q_proj", rank=99, alpha=99.0, op_names=("dot_general",)),  # q is an einsum: not this one
         Rule("layers/1/.*", rank=4, alpha=3.0),
         Rule(".*", rank=2, alpha=5.0)]


def _factors(rng):
    """Layer 0: every weight at rank 2; layer 1: q and down at rank 4 (another rule)."""
    out = {}
    for layer, rank, weights in ((0, 2, list(WEIGHTS)), (1, 4, ["attn.q_proj.w", "mlp.down_proj.kernel"])):
        for weight in weights:
            _, _, a_axes, b_axes, _ = WEIGHTS[weight]
            out[f"layers.{layer}.{weight}_lora_a"] = rng.normal(size=(*a_axes, rank)).astype(np.float32)
            out[f"layers.{layer}.{weight}_lora_b"] = rng.normal(size=(rank, *b_axes)).astype(np.float32)
    return out


def _shapes():
    dims = {"q_proj": (D, N * H), "k_proj": (D, K * H), "v_proj": (D, K * H), "o_proj": (N * H, D),
            "gate_proj": (D, F), "up_proj": (D, F), "down_proj": (F, D)}
    return {(layer, name): dims[name] for layer in (0, 1) for name in dims}


def test_qwix_factors_give_qwix_deltas_through_the_peft_form():
    rng = np.random.default_rng(0)
    factors = _factors(rng)
    rank_alpha = module_rank_alpha(factors, RULES)
    assert rank_alpha["layers.0.attn.q_proj"] == (2, 5.0) and rank_alpha["layers.1.mlp.down_proj"] == (4, 3.0)
    config, tensors = qwix_lora_to_peft(factors, rank_alpha)
    assert config["target_modules"] == sorted(name for name, *_ in WEIGHTS.values())
    assert tensors["base_model.model.model.layers.0.self_attn.o_proj.lora_A.weight"].shape == (2, N * H)  # [r, in]
    assert tensors["base_model.model.model.layers.0.self_attn.o_proj.lora_B.weight"].shape == (D, 2)      # [out, r]
    adapter = peft_adapter_from_memory(LoRARequest("policy", 1, "memory://policy"), config, tensors, _shapes(),
                                       max_rank=8)
    assert set(adapter.weights) == {(0, n) for n, *_ in WEIGHTS.values()} | {(1, "q_proj"), (1, "down_proj")}
    for name, value in factors.items():
        if not name.endswith("_lora_a"):
            continue
        weight_path = name[:-len("_lora_a")]  # layers.{i}.<weight>
        _, layer, weight = weight_path.split(".", 2)
        projection, equation, _, _, lhs_axes = WEIGHTS[weight]
        rank, alpha = rank_alpha[weight_path.rsplit(".", 1)[0]]
        x = rng.normal(size=(B, T, *lhs_axes)).astype(np.float32)
        qwix_delta = np.einsum(equation, x, value, factors[weight_path + "_lora_b"]) * (alpha / rank)
        a, b = adapter.weights[(int(layer), projection)]  # [in, max_rank], [max_rank, out], scale folded in
        ours = x.reshape(B, T, -1) @ a @ b  # the Hugging Face layout: heads flattened row-major
        np.testing.assert_allclose(ours, qwix_delta.reshape(B, T, -1), rtol=1e-5, atol=1e-5, err_msg=name)


def test_one_rule_gives_a_plain_config_and_lora_alpha_overrides_the_rules():
    rng = np.random.default_rng(1)
    factors = {k: v for k, v in _factors(rng).items() if k.startswith("layers.0.")}
    config, _ = qwix_lora_to_peft(factors, module_rank_alpha(factors, RULES))
    assert (config["r"], config["lora_alpha"], config["rank_pattern"], config["alpha_pattern"]) == (2, 5.0, {}, {})
    assert set(module_rank_alpha(factors, None, lora_alpha=7.0).values()) == {(2, 7.0)}


def test_what_cannot_be_mapped_is_a_value_error():
    rng = np.random.default_rng(2)
    factors = _factors(rng)
    with pytest.raises(ValueError, match="lora_alpha"):  # no provider found and no alpha given
        module_rank_alpha(factors, None)
    head = {"lm_head.w_lora_a": rng.normal(size=(D, 2)), "lm_head.w_lora_b": rng.normal(size=(2, 256))}
    with pytest.raises(ValueError, match="lm_head.w.*q_proj"):
        qwix_lora_to_peft(head, {"lm_head": (2, 5.0)})
    lonely = {"layers.0.attn.q_proj.w_lora_a": factors["layers.0.attn.q_proj.w_lora_a"]}
    with pytest.raises(ValueError, match="w_lora_b is missing"):
        qwix_lora_to_peft(lonely, module_rank_alpha(lonely, RULES))
    with pytest.raises(ValueError, match="no qwix LoRA rule"):
        module_rank_alpha(factors, [Rule("nothing", rank=2, alpha=1.0)])
