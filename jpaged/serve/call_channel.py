"""An ordered stream of messages from process 0 to the other processes of a `jax.distributed` job,
over the key-value store of the coordination service that `jax.distributed.initialize` starts.

Every process of a multi-host engine already talks to that service (process 0 runs it), under Ray
and under Kubernetes alike, so it needs no other connection and no device: a message is one
key set on the leader, ``<prefix>/<n // GROUP>/<n>``, and a follower's wait for its next key is a
blocking get with a timeout (it can notice its own stop between waits). After each group's last
message a follower writes how far it has read to ``<prefix>/read/<process id>``; the leader
deletes a whole group once every follower has read past it, so the store holds a few groups at
most however long the job serves.

The client is JAX's (``jax._src.distributed.global_state.client``, the one orbax's multi-host
barriers use too); `coordination_client` is the one place that reaches it.
"""

GROUP = 32  # messages per key directory: the unit the leader deletes, and how often followers say how far they read


def coordination_client():
    """This process's client of the `jax.distributed` coordination service."""
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("jax.distributed is not initialized: a multi-host engine's processes join it first")
    return client


def _message_key(prefix: str, n: int) -> str:
    return f"{prefix}/{n // GROUP}/{n}"


def _read_key(prefix: str, process_id: int) -> str:
    return f"{prefix}/read/{process_id}"


def _is_timeout(error: Exception) -> bool:
    return "DEADLINE_EXCEEDED" in str(error)


class LeaderChannel:
    """Process 0's end: `send` appends one message for every other process."""

    def __init__(self, client, num_processes: int, prefix: str = "jpaged/engine_calls"):
        self.client, self.prefix = client, prefix
        self.followers = range(1, num_processes)
        self.num_sent = 0
        self.num_groups_deleted = 0

    def send(self, payload: bytes) -> None:
        self.client.key_value_set_bytes(_message_key(self.prefix, self.num_sent), payload)
        self.num_sent += 1
        if self.num_sent % GROUP == 0:
            self._delete_read_groups()

    def _read_up_to(self, process_id: int) -> int:
        """The last message ``process_id`` said it read (-1: none yet)."""
        try:
            return int(self.client.key_value_try_get(_read_key(self.prefix, process_id)))
        except Exception as e:  # noqa: BLE001 -- NOT_FOUND: it has not finished a group yet
            if "NOT_FOUND" in str(e):
                return -1
            raise

    def _delete_read_groups(self) -> None:
        read = min((self._read_up_to(p) for p in self.followers), default=self.num_sent - 1)
        while (self.num_groups_deleted + 1) * GROUP - 1 <= read:
            self.client.key_value_delete(f"{self.prefix}/{self.num_groups_deleted}/")
            self.num_groups_deleted += 1


class FollowerChannel:
    """Process ``process_id``'s end: `receive` returns the leader's messages in order."""

    def __init__(self, client, process_id: int, prefix: str = "jpaged/engine_calls"):
        if process_id < 1:
            raise ValueError(f"process_id={process_id}: process 0 is the leader, it sends")
        self.client, self.process_id, self.prefix = client, process_id, prefix
        self.num_received = 0

    def receive(self, timeout_s: float) -> bytes | None:
        """The next message, or None when none came within ``timeout_s``."""
        try:
            payload = self.client.blocking_key_value_get_bytes(_message_key(self.prefix, self.num_received),
                                                               max(1, int(timeout_s * 1000)))
        except Exception as e:  # noqa: BLE001 -- the service's errors are JaxRuntimeErrors with a status
            if _is_timeout(e):
                return None
            raise
        self.num_received += 1
        if self.num_received % GROUP == 0:
            self.client.key_value_set(_read_key(self.prefix, self.process_id), str(self.num_received - 1),
                                      allow_overwrite=True)
        return payload
