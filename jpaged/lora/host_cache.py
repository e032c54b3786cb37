"""The host cache of loaded adapters: ``max_cpu_loras`` read from disk (LRU), and those given in memory."""
import threading
from collections import OrderedDict

from jpaged.lora.peft_adapter import LoRAAdapter, load_peft_adapter


class HostAdapterCache:
    """Adapters read and checked once, kept on the host up to ``capacity`` (least recently used
    evicted first; an evicted one is read again from its path when next needed). Adapters given in
    memory (`put`) cannot be read again, so they stay until removed and do not count against
    ``capacity``. Safe from any thread (requests are checked on the server's worker threads, slots
    filled on the engine's)."""

    def __init__(self, capacity: int, shapes: dict, max_rank: int, dtype):
        self.capacity, self.shapes, self.max_rank, self.dtype = capacity, shapes, max_rank, dtype
        self._adapters: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self._in_memory: dict[int, LoRAAdapter] = {}
        self.num_loads = 0
        self._lock = threading.RLock()

    def __contains__(self, lora_int_id: int) -> bool:
        return lora_int_id in self._adapters or lora_int_id in self._in_memory

    def __len__(self) -> int:
        return len(self._adapters) + len(self._in_memory)

    def get(self, request) -> LoRAAdapter:
        """The adapter of a `LoRARequest`, read from its path if not cached (ValueError if bad)."""
        with self._lock:
            return self._get(request)

    def put(self, adapter: LoRAAdapter) -> None:
        """Keeps an adapter given in memory (replacing the one of its id: new factors)."""
        with self._lock:
            known = self._in_memory.get(adapter.int_id) or self._adapters.get(adapter.int_id)
            if known is not None:
                self._check_same(known, adapter.int_id, adapter.name, adapter.path)
            self._adapters.pop(adapter.int_id, None)
            self._in_memory[adapter.int_id] = adapter

    def _get(self, request) -> LoRAAdapter:
        adapter = self._in_memory.get(request.lora_int_id) or self._adapters.get(request.lora_int_id)
        if adapter is not None:
            self._check_same(adapter, request.lora_int_id, request.lora_name, request.lora_path)
        else:
            adapter = load_peft_adapter(request, self.shapes, self.max_rank, self.dtype)
            self.num_loads += 1
            self._adapters[request.lora_int_id] = adapter
            while len(self._adapters) > self.capacity:
                self._adapters.popitem(last=False)
        if request.lora_int_id in self._adapters:
            self._adapters.move_to_end(request.lora_int_id)
        return adapter

    @staticmethod
    def _check_same(adapter: LoRAAdapter, lora_int_id: int, name: str, path: str) -> None:
        if (adapter.name, adapter.path) != (name, path):
            raise ValueError(f"lora_int_id={lora_int_id}: already names adapter {adapter.name!r} "
                             f"({adapter.path}), not {name!r} ({path})")

    def remove(self, lora_int_id: int) -> None:
        with self._lock:
            self._adapters.pop(lora_int_id, None)
            self._in_memory.pop(lora_int_id, None)
