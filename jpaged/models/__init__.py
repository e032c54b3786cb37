"""Model registry: Hugging Face architecture name -> jpaged NNX model class."""
from jpaged.models.deepseek import DeepseekForCausalLM
from jpaged.models.gemma import GemmaForCausalLM
from jpaged.models.gpt2 import GPT2LMHeadModel
from jpaged.models.gpt_oss import GptOssForCausalLM
from jpaged.models.llama import LlamaForCausalLM
from jpaged.models.llama4 import Llama4ForCausalLM
from jpaged.models.mixtral import MixtralForCausalLM
from jpaged.models.model_config import ModelConfig
from jpaged.models.opt import OPTForCausalLM
from jpaged.models.qwen3_moe import Qwen3MoeForCausalLM
from jpaged.models.qwen3_next import Qwen3NextForCausalLM

MODEL_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "OPTForCausalLM": OPTForCausalLM,
    "GPT2LMHeadModel": GPT2LMHeadModel,
    "GptOssForCausalLM": GptOssForCausalLM,
    "Llama4ForCausalLM": Llama4ForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekForCausalLM,
    "Qwen3NextForCausalLM": Qwen3NextForCausalLM,
    "Qwen3_5ForCausalLM": Qwen3NextForCausalLM,
}


def model_class(config: ModelConfig):
    """The class that serves ``config``; a ValueError naming the config.json field when none can
    (an unknown architecture, or a feature the class does not implement)."""
    try:
        cls = MODEL_REGISTRY[config.architecture]
    except KeyError:
        raise ValueError(f"architectures=[{config.architecture!r}]: not supported; "
                         f"supported: {sorted(MODEL_REGISTRY)}") from None
    check = getattr(cls, "check_config", None)
    if check is not None:
        check(config)
    return cls
