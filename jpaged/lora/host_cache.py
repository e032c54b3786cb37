"""The host LRU cache of loaded adapters (``max_cpu_loras`` of them)."""
import threading
from collections import OrderedDict

from jpaged.lora.peft_adapter import LoRAAdapter, load_peft_adapter


class HostAdapterCache:
    """Adapters read and checked once, kept on the host up to ``capacity`` (least recently used
    evicted first; an evicted one is read again from its path when next needed). Safe from any
    thread (requests are checked on the server's worker threads, slots filled on the engine's)."""

    def __init__(self, capacity: int, shapes: dict, max_rank: int, dtype):
        self.capacity, self.shapes, self.max_rank, self.dtype = capacity, shapes, max_rank, dtype
        self._adapters: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self.num_loads = 0
        self._lock = threading.RLock()

    def __contains__(self, lora_int_id: int) -> bool:
        return lora_int_id in self._adapters

    def __len__(self) -> int:
        return len(self._adapters)

    def get(self, request) -> LoRAAdapter:
        """The adapter of a `LoRARequest`, read from its path if not cached (ValueError if bad)."""
        with self._lock:
            return self._get(request)

    def _get(self, request) -> LoRAAdapter:
        adapter = self._adapters.get(request.lora_int_id)
        if adapter is not None and (adapter.name, adapter.path) != (request.lora_name, request.lora_path):
            raise ValueError(f"lora_int_id={request.lora_int_id}: already names adapter {adapter.name!r} "
                             f"({adapter.path}), not {request.lora_name!r} ({request.lora_path})")
        if adapter is None:
            adapter = load_peft_adapter(request, self.shapes, self.max_rank, self.dtype)
            self.num_loads += 1
            self._adapters[request.lora_int_id] = adapter
            while len(self._adapters) > self.capacity:
                self._adapters.popitem(last=False)
        self._adapters.move_to_end(request.lora_int_id)
        return adapter

    def remove(self, lora_int_id: int) -> None:
        with self._lock:
            self._adapters.pop(lora_int_id, None)
