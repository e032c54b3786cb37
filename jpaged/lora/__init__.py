"""LoRA adapters served beside the base model (docs/lora.md): `LoRARequest` per request, PEFT
adapters read on the host (`peft_adapter`), a host LRU cache (`host_cache`), device slots pinned
by running requests (`slot_table`) and written on demand (`device_slots`)."""
from jpaged.lora.request import LoRARequest

__all__ = ["LoRARequest"]
