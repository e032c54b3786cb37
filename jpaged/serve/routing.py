"""Which replica serves a request: the one holding the longest cached prefix of its prompt, the
least loaded one, or the next in turn.

Replicas report the keys of their prefix cache (`BlockPool.cached`: the hash chain
`KVCacheManager` computes over full blocks, the request's ``cache_salt`` at its root) and their load.
`prompt_block_hashes` computes the same chain for a prompt, so a request matches a replica's blocks
exactly when that replica's prefix cache would find them. Python hashes tuples of ints the same in
every process (an unsalted chain's root is the int `UNSALTED_ROOT`, not None); a salted root hashes a string, which matches across processes only when they share
``PYTHONHASHSEED`` (the Ray Serve app sets one for all its actors); otherwise salted prompts match
nothing and are routed by load, never to another salt's blocks.
"""
import dataclasses
import itertools
import time

from jpaged.core.kv_cache_manager import UNSALTED_ROOT

POLICIES = ("prefix", "least_loaded", "round_robin")


def prompt_block_hashes(token_ids, block_size: int, cache_salt: str | None = None) -> list[int]:
    """The prefix-cache keys of the prompt's full blocks that a cache lookup can hit (the last
    token is always recomputed, so ``(len - 1) // block_size`` of them), as `KVCacheManager` keys
    them (kv cache group 0, weights never updated)."""
    parent = UNSALTED_ROOT if cache_salt is None else hash(("salt", cache_salt))
    keys = []
    for i in range(max(0, (len(token_ids) - 1) // block_size)):
        parent = hash((parent, tuple(token_ids[i * block_size:(i + 1) * block_size])))
        keys.append(parent)
    return keys


@dataclasses.dataclass
class ReplicaState:
    """What the router knows of one replica: its last report and the requests routed to it."""

    name: str
    ready: bool = False
    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0
    block_size: int = 0
    block_hashes: frozenset = frozenset()
    in_flight: int = 0  # requests the router sent and that have not ended (fresher than a report)
    routed: dict = dataclasses.field(default_factory=dict)  # block hash -> when the router sent it here

    def load(self) -> tuple:
        """Smaller is less loaded: requests on it (the router's own count, the replica's queue), then KV
        use, then how much it caches (so that new prefixes spread over idle replicas)."""
        return (max(self.in_flight, self.running + self.waiting), self.kv_cache_usage,
                len(self.block_hashes) + len(self.routed))

    def update(self, report: dict) -> None:
        self.ready = True
        self.running, self.waiting = report["num_requests_running"], report["num_requests_waiting"]
        self.kv_cache_usage, self.block_size = report["kv_cache_usage"], report["block_size"]
        self.block_hashes = frozenset(report["block_hashes"])

    def matched_blocks(self, keys: list[int], now: float, ttl: float) -> int:
        """How many leading blocks of a prompt this replica holds or was just sent."""
        n = 0
        for key in keys:
            if key not in self.block_hashes and now - self.routed.get(key, -ttl) >= ttl:
                break
            n += 1
        return n


class Router:
    """Chooses a replica per request by ``policy`` (one of `POLICIES`).

    ``prefix``: the ready replica matching most leading blocks of the prompt; among equals, and when
    nothing matches, the least loaded; when the best match is more than ``max_imbalance`` requests
    busier than the least loaded replica, the least loaded one (a hot prefix does not pile onto one
    replica). A prompt just routed counts as cached on its replica for ``routed_ttl`` seconds, until
    the replica's own report (which comes every poll) can say so.
    """

    def __init__(self, names, policy: str = "prefix", max_imbalance: int = 8, routed_ttl: float = 10.0):
        if policy not in POLICIES:
            raise ValueError(f"routing: {policy!r} is not one of {', '.join(POLICIES)}")
        self.policy, self.max_imbalance, self.routed_ttl = policy, max_imbalance, routed_ttl
        self.replicas = {name: ReplicaState(name) for name in names}
        self._turn = itertools.count()

    def ready(self, exclude=()) -> list[ReplicaState]:
        return [r for r in self.replicas.values() if r.ready and r.name not in exclude]

    def choose(self, token_ids=None, cache_salt: str | None = None, exclude=()) -> tuple[ReplicaState | None, int]:
        """(the replica for a prompt, how many of its blocks that replica holds); (None, 0) when no
        replica outside ``exclude`` is ready. ``token_ids`` None: nothing to match (routed by load)."""
        ready = self.ready(exclude)
        if not ready:
            return None, 0
        if self.policy == "round_robin":
            return ready[next(self._turn) % len(ready)], 0
        least = min(ready, key=ReplicaState.load)
        if self.policy == "least_loaded" or not token_ids:
            return least, 0
        now = time.monotonic()
        keys = prompt_block_hashes(token_ids, least.block_size or 1, cache_salt) if least.block_size else []
        matches = {r.name: r.matched_blocks(keys, now, self.routed_ttl) for r in ready}
        best = max(matches.values(), default=0)
        if best == 0:
            chosen = least
        else:
            chosen = min((r for r in ready if matches[r.name] == best), key=ReplicaState.load)
            if chosen.load()[0] - least.load()[0] > self.max_imbalance:
                chosen = least
        for key in keys:
            chosen.routed[key] = now
        if len(chosen.routed) > 4 * max(1, len(chosen.block_hashes)) + 4096:  # forget what the reports cover
            chosen.routed = {k: t for k, t in chosen.routed.items() if now - t < self.routed_ttl}
        return chosen, matches[chosen.name]
