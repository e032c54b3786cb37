"""`LoRARequest`: which adapter a request runs with (vLLM's name and fields)."""
from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter to serve a request with: a PEFT directory (``adapter_config.json`` and
    ``adapter_model.safetensors``) under a name and a positive integer id, both unique per adapter."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name: expected a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id: expected an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path: expected a path, got {self.lora_path!r}")
