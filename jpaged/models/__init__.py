"""Model registry: Hugging Face architecture name -> jpaged NNX model class."""
from jpaged.models.gpt2 import GPT2LMHeadModel
from jpaged.models.llama import LlamaForCausalLM
from jpaged.models.model_config import ModelConfig
from jpaged.models.opt import OPTForCausalLM

MODEL_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "OPTForCausalLM": OPTForCausalLM,
    "GPT2LMHeadModel": GPT2LMHeadModel,
}


def model_class(config: ModelConfig):
    try:
        return MODEL_REGISTRY[config.architecture]
    except KeyError:
        raise ValueError(f"architecture {config.architecture!r} is not supported; "
                         f"supported: {sorted(MODEL_REGISTRY)}") from None
