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
        self.swapped: dict[str, dict[int, list[int]]] = {}  # request id -> {seq_id: host blocks}

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    def swap_out(self, request_id: str, tables: dict[int, list[int]]) -> list[tuple[int, int]] | None:
        """Host blocks for the device blocks of each sequence (``{seq_id: block table}``): the
        (device block, host block) pairs to copy, or None (nothing taken) when there is no room."""
        need = sum(map(len, tables.values()))
        if need > len(self.free_blocks):
            return None
        pairs, held = [], {}
        for seq_id, table in tables.items():
            held[seq_id] = [self.free_blocks.pop() for _ in table]
            pairs += zip(table, held[seq_id])
        self.swapped[request_id] = held
        return pairs

    def is_swapped(self, request_id: str) -> bool:
        return request_id in self.swapped

    def swap_in(self, request_id: str, tables: dict[int, list[int]]) -> list[tuple[int, int]]:
        """The (host block, device block) pairs that bring a swapped request back into the first
        blocks of its new tables; its host blocks are free again after the step's copy."""
        pairs = []
        for seq_id, host in self.swapped.pop(request_id).items():
            pairs += zip(host, tables[seq_id][:len(host)])
            self.free_blocks += host
        return pairs

    def free(self, request_id: str) -> None:
        """Forgets a request's host blocks (it ended while swapped out)."""
        for host in self.swapped.pop(request_id, {}).values():
            self.free_blocks += host
