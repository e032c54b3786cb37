"""Which adapter each device slot holds: plain host bookkeeping, no JAX inside.

Slots 1..``max_loras`` hold adapters (slot 0 is the base model). A request pins its adapter's slot
from admission until it is preempted or ends; a pinned slot is never evicted. An adapter without a
slot takes a free one, else the least recently used unpinned one; when every slot is pinned the
request waits. A newly assigned slot is reported once (`take_loads`) so the runner fills it.
The scheduler calls it on the engine's thread; `evict` (a server unloading an adapter) may come
from another, hence the lock.
"""
import threading
from collections import Counter, OrderedDict


class LoRASlotTable:
    def __init__(self, max_loras: int):
        self.max_loras = max_loras
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # lora_int_id -> slot, least recent first
        self.pins: Counter[int] = Counter()                   # slot -> requests using it now
        self._loads: list[tuple[int, object]] = []           # (slot, LoRARequest) to fill
        self.num_evictions = 0
        self._lock = threading.Lock()

    def acquire(self, request) -> int | None:
        """Pins a slot holding ``request``'s adapter (a `LoRARequest`); None when all are pinned."""
        with self._lock:
            return self._acquire(request)

    def _acquire(self, request) -> int | None:
        slot = self.slot_of.get(request.lora_int_id)
        if slot is None:
            slot = self._free_slot()
            if slot is None:
                return None
            self.slot_of[request.lora_int_id] = slot
            self._loads.append((slot, request))
        self.slot_of.move_to_end(request.lora_int_id)
        self.pins[slot] += 1
        return slot

    def release(self, slot: int) -> None:
        with self._lock:
            if self.pins[slot] <= 0:
                raise RuntimeError(f"LoRA slot {slot} released more often than acquired")
            self.pins[slot] -= 1

    def _free_slot(self) -> int | None:
        used = set(self.slot_of.values())
        for slot in range(1, self.max_loras + 1):
            if slot not in used:
                return slot
        for lora_int_id, slot in self.slot_of.items():  # least recently used first
            if self.pins[slot] == 0:
                del self.slot_of[lora_int_id]
                self._loads = [(s, r) for s, r in self._loads if s != slot]
                self.num_evictions += 1
                return slot
        return None

    def evict(self, lora_int_id: int) -> bool:
        """Forgets an unpinned adapter's slot (an unloaded adapter); False if it is in use."""
        with self._lock:
            slot = self.slot_of.get(lora_int_id)
            if slot is None:
                return True
            if self.pins[slot]:
                return False
            del self.slot_of[lora_int_id]
            self._loads = [(s, r) for s, r in self._loads if s != slot]
            return True

    def forget_slot(self, slot: int) -> None:
        """Drops whatever adapter ``slot`` was assigned (its write failed: the step's requests,
        the only ones pinning it, end with an error and release it)."""
        with self._lock:
            for lora_int_id in [i for i, s in self.slot_of.items() if s == slot]:
                del self.slot_of[lora_int_id]

    def take_loads(self) -> list[tuple[int, object]]:
        """The (slot, LoRARequest) pairs assigned since the last call: the runner writes them."""
        with self._lock:
            loads, self._loads = self._loads, []
            return loads

    @property
    def num_pinned(self) -> int:
        return sum(1 for n in self.pins.values() if n)
