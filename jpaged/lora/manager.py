"""`LoRAManager`: the engine's adapters: host cache, device slot table, and the checks."""
from collections import Counter

import numpy as np

from jpaged.lora.host_cache import HostAdapterCache
from jpaged.lora.peft_adapter import peft_adapter_from_memory
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
        self.max_loras, self.max_lora_rank, self.dtype = max_loras, max_lora_rank, np.dtype(dtype)
        self.num_slots = max_loras + 1
        self.shapes = attach_lora(model, self.num_slots, max_lora_rank, dtype, delta=delta)
        self.host = HostAdapterCache(max_cpu_loras, self.shapes, max_lora_rank, self.dtype)
        self.slots = LoRASlotTable(max_loras)
        self.names: dict[str, LoRARequest] = {}  # every adapter seen, by name (the server's lookups)
        self.versions: Counter[int] = Counter()  # lora_int_id -> times its factors were replaced

    def check(self, request) -> LoRARequest:
        """Validates a `LoRARequest` (reading its adapter into the host cache): ValueError if bad."""
        self._check_name(request)
        self.host.get(request)
        self.names[request.lora_name] = request
        return request

    def _check_name(self, request) -> None:
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request: expected a LoRARequest, got {type(request).__name__}")
        known = self.names.get(request.lora_name)
        if known is not None and known != request:
            raise ValueError(f"lora_name={request.lora_name!r}: already names lora_int_id={known.lora_int_id} "
                             f"({known.lora_path})")

    def update(self, request, tensors: dict, config: dict) -> int | None:
        """Serves ``request``'s adapter from memory (PEFT ``config`` fields and ``{PEFT tensor
        name: array}``): the first call registers it, a later one replaces its factors and bumps
        its version (`cache_key`). Returns the device slot holding the old factors (None: none),
        which the caller rewrites. Checked first: a ValueError changes nothing."""
        self._check_name(request)
        adapter = peft_adapter_from_memory(request, config, tensors, self.shapes, self.max_lora_rank, self.dtype)
        self.host.put(adapter)
        self.names[request.lora_name] = request
        self.versions[request.lora_int_id] += 1
        return self.slots.slot_of.get(request.lora_int_id)

    def cache_key(self, request) -> str:
        """What a request's prefix-cache blocks depend on of its adapter: id, name and factors'
        version (blocks computed under replaced factors never match again)."""
        return f"{request.lora_int_id}/{request.lora_name}/v{self.versions[request.lora_int_id]}"

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
        self.versions[request.lora_int_id] += 1  # an id used again later names other factors
        return True

    def metrics(self) -> dict:
        return {"lora_slots_in_use": self.slots.num_pinned, "lora_slots_filled": len(self.slots.slot_of),
                "lora_host_adapters": len(self.host), "lora_adapter_loads": self.host.num_loads,
                "lora_slot_evictions": self.slots.num_evictions}
