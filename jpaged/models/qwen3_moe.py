"""Qwen3-MoE (``Qwen3MoeForCausalLM``): the Qwen3 decoder (per-head q/k norms) whose MLPs are sparse
mixtures of SwiGLU experts of ``moe_intermediate_size`` (`jpaged.models.moe`), no shared expert:
each token goes to the top ``num_experts_per_tok`` of ``num_experts``, weighted by the router's
softmax (renormalized over them with ``norm_topk_prob``). Layers in ``mlp_only_layers``, and all but
every ``decoder_sparse_step``-th, keep a dense MLP of ``intermediate_size``."""
import jax.numpy as jnp
from flax import nnx

from jpaged.models.llama import LlamaForCausalLM, LlamaMLP
from jpaged.models.mixtral import experts_per_token, num_experts
from jpaged.models.model_config import ModelConfig
from jpaged.models.moe import SparseMoE


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    """`LlamaForCausalLM` (Qwen3 attention) with `SparseMoE` MLPs; ``expert_parallel``: whole experts
    per device."""

    HAS_EXPERTS = True

    def __init__(self, config: ModelConfig, *, dtype=jnp.float32, attention_backend: str = "xla",
                 rngs: nnx.Rngs, expert_parallel: bool = False):
        self.expert_parallel = expert_parallel
        super().__init__(config, dtype=dtype, attention_backend=attention_backend, rngs=rngs)

    @classmethod
    def check_config(cls, config: ModelConfig) -> None:
        super().check_config(config)
        text = config.hf.get("text_config") or config.hf
        if text.get("shared_expert_intermediate_size"):
            raise ValueError(f"shared_expert_intermediate_size={text['shared_expert_intermediate_size']!r}: "
                             "Qwen3-MoE has no shared expert")

    def is_sparse(self, layer: int) -> bool:
        text = self.config.hf.get("text_config") or self.config.hf
        step = text.get("decoder_sparse_step", 1)
        return layer not in text.get("mlp_only_layers", []) and (layer + 1) % step == 0

    def make_mlp(self, c: ModelConfig, layer: int, dtype, rngs: nnx.Rngs) -> nnx.Module:
        if not self.is_sparse(layer):
            return LlamaMLP(c, dtype, rngs)
        text = c.hf.get("text_config") or c.hf
        return SparseMoE(c.hidden_size, text["moe_intermediate_size"], num_experts(c), experts_per_token(c),
                         normalize=bool(text.get("norm_topk_prob", False)), hidden_act=c.hidden_act, dtype=dtype,
                         rngs=rngs, expert_parallel=self.expert_parallel)

    def mlp_weight_map(self, layer: int, path: tuple, prefix: str):
        if not self.is_sparse(layer):
            return super().mlp_weight_map(layer, path, prefix)
        moe, p = path + ("mlp",), prefix + "mlp."
        out = [(moe + ("router",), p + "gate.weight", True)]
        for e in range(num_experts(self.config)):
            out += [(moe + ("experts", proj, e), f"{p}experts.{e}.{proj}.weight", True)
                    for proj in ("gate_proj", "up_proj", "down_proj")]
        return out
