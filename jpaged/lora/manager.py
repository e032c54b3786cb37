"""`LoRAManager`: the engine's adapters: host cache, device slot table, and the checks."""
import numpy as np

from jpaged.lora.host_cache import HostAdapterCache
from jpaged.lora.request import LoRARequest
from jpaged.lora.slot_table import LoRASlotTable
from jpaged.models.lora import attach_lora


class LoRAManager:
    """Built once per engine with ``enable_lora``: gives the model its ``max_loras + 1`` zero slot
    stacks (slot 0: the base model), reads adapters into a host LRU cache of ``max_cpu_loras``,
    and owns the slot table the scheduler pins slots in."""

    def __init__(self, model, *, max_loras: int, max_lora_rank: int, max_cpu_loras: int, dtype,
                 delta: str = "ragged"):
        """``delta``: the form the model's projections compute deltas in (`jpaged.models.lora`)."""
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        self.num_slots = max_loras + 1
        self.shapes = attach_lora(model, self.num_slots, max_lora_rank, dtype, delta=delta)
        self.host = HostAdapterCache(max_cpu_loras, self.shapes, max_lora_rank, np.dtype(dtype))
        self.slots = LoRASlotTable(max_loras)
        self.names: dict[str, LoRARequest] = {}  # every adapter seen, by name (the server's lookups)

    def check(self, request) -> LoRARequest:
        """Validates a `LoRARequest` (reading its adapter into the host cache): ValueError if bad."""
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request: expected a LoRARequest, got {type(request).__name__}")
        known = self.names.get(request.lora_name)
        if known is not None and known != request:
            raise ValueError(f"lora_name={request.lora_name!r}: already names lora_int_id={known.lora_int_id} "
                             f"({known.lora_path})")
        self.host.get(request)
        self.names[request.lora_name] = request
        return request

    def adapter(self, request):
        """The host copy of a request's adapter (read again if the host cache evicted it)."""
        return self.host.get(request)

    def remove(self, lora_name: str) -> bool:
        """Forgets an adapter (its host copy and its idle device slot); False if running requests use it."""
        request = self.names.get(lora_name)
        if request is None:
            raise ValueError(f"lora_name={lora_name!r}: no such adapter")
        if not self.slots.evict(request.lora_int_id):
            return False
        self.host.remove(request.lora_int_id)
        del self.names[lora_name]
        return True

    def metrics(self) -> dict:
        return {"lora_slots_in_use": self.slots.num_pinned, "lora_slots_filled": len(self.slots.slot_of),
                "lora_host_adapters": len(self.host), "lora_adapter_loads": self.host.num_loads,
                "lora_slot_evictions": self.slots.num_evictions}
