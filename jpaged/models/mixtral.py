"""Mixtral (``MixtralForCausalLM``): the Llama decoder (with Mistral's sliding window when the config
sets one) whose MLPs are sparse mixtures of SwiGLU experts (`jpaged.models.moe`): each token goes
to the top ``num_experts_per_tok`` of ``num_local_experts`` experts, weighted by the router's
softmax renormalized over them."""
import jax.numpy as jnp
from flax import nnx

from jpaged.models.llama import LlamaForCausalLM
from jpaged.models.model_config import ModelConfig
from jpaged.models.moe import SparseMoE

# our stacked expert weight -> Mixtral's per-expert name (w1: gate, w3: up, w2: down)
EXPERT_NAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def num_experts(c: ModelConfig) -> int:
    text = c.hf.get("text_config") or c.hf
    n = text.get("num_local_experts", text.get("num_experts"))
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"num_local_experts={n!r}: must be a positive integer")
    return n


def experts_per_token(c: ModelConfig) -> int:
    return (c.hf.get("text_config") or c.hf).get("num_experts_per_tok", 2)


class MixtralForCausalLM(LlamaForCausalLM):
    """`LlamaForCausalLM` with `SparseMoE` MLPs; ``expert_parallel``: whole experts per device."""

    HAS_EXPERTS = True

    def __init__(self, config: ModelConfig, *, dtype=jnp.float32, attention_backend: str = "xla",
                 rngs: nnx.Rngs, expert_parallel: bool = False):
        self.expert_parallel = expert_parallel
        super().__init__(config, dtype=dtype, attention_backend=attention_backend, rngs=rngs)

    def make_mlp(self, c: ModelConfig, layer: int, dtype, rngs: nnx.Rngs) -> nnx.Module:
        return SparseMoE(c.hidden_size, c.intermediate_size, num_experts(c), experts_per_token(c), normalize=True,
                         hidden_act=c.hidden_act, dtype=dtype, rngs=rngs, expert_parallel=self.expert_parallel)

    def mlp_weight_map(self, layer: int, path: tuple, prefix: str):
        moe, p = path + ("mlp",), prefix + "block_sparse_moe."
        out = [(moe + ("router",), p + "gate.weight", True)]
        for e in range(num_experts(self.config)):  # one slice (index e) of each stacked weight
            out += [(moe + ("experts", ours, e), f"{p}experts.{e}.{theirs}.weight", True)
                    for ours, theirs in EXPERT_NAMES.items()]
        return out
