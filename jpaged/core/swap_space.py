"""Host memory for preempted requests' KV blocks (``preemption_mode="swap"``), by block id.

The swap space is a second, smaller pool of blocks in host memory. A request swapped out gets host
blocks for every block of its sequences; the step copies device -> host (``swap_out`` pairs), and
when it resumes, host -> its new device blocks (``swap_in`` pairs). This class is the one owner of
that state: which host blocks hold which request's sequences. The runner keeps only the host
buffer and copies by the block ids a step gives it.
"""


class SwapSpace:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.free_blocks = list(range(num_blocks - 1, -1, -1))  # popped from the end: 0 first
        self.swapped: dict[str, dict] = {}  # request id -> {table key: [(table index, host block)]}

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    def swap_out(self, request_id: str, tables: dict) -> list[tuple[int, int]] | None:
        """Host blocks for the device blocks of each table (``{key: block table}``, a key per
        sequence and KV-cache group; entries a sliding window released, -1, take none): the
        (device block, host block) pairs to copy, or None (nothing taken) when there is no room."""
        need = sum(b >= 0 for table in tables.values() for b in table)
        if need > len(self.free_blocks):
            return None
        pairs, held = [], {}
        for key, table in tables.items():
            held[key] = [(i, self.free_blocks.pop()) for i, b in enumerate(table) if b >= 0]
            pairs += [(table[i], host) for i, host in held[key]]
        self.swapped[request_id] = held
        return pairs

    def is_swapped(self, request_id: str) -> bool:
        return request_id in self.swapped

    def swap_in(self, request_id: str, tables: dict) -> list[tuple[int, int]]:
        """The (host block, device block) pairs that bring a swapped request back into the same
        places of its new tables (a block its window has left behind meanwhile stays out); its host
        blocks are free again after the step's copy."""
        pairs = []
        for key, host in self.swapped.pop(request_id).items():
            pairs += [(h, tables[key][i]) for i, h in host if tables[key][i] >= 0]
            self.free_blocks += [h for _, h in host]
        return pairs

    def free(self, request_id: str) -> None:
        """Forgets a request's host blocks (it ended while swapped out)."""
        for host in self.swapped.pop(request_id, {}).values():
            self.free_blocks += [h for _, h in host]
