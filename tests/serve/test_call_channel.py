"""`call_channel`: the leader's messages over a real coordination service (JAX's, started here on
127.0.0.1 with one client per process, all in this process): in order at every follower, a wait
that ends with None, and a group deleted only once every follower has read past it."""
import socket
import threading

import pytest

from jpaged.serve.call_channel import GROUP, FollowerChannel, LeaderChannel


@pytest.fixture
def clients():
    from jax._src.lib import _jax

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    service = _jax.get_distributed_runtime_service(address, 3)
    clients = [_jax.get_distributed_runtime_client(address, i, init_timeout=30) for i in range(3)]
    threads = [threading.Thread(target=c.connect) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    yield clients
    threads = [threading.Thread(target=c.shutdown) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    service.shutdown()


def stored_groups(client, prefix="jpaged/engine_calls") -> set[int]:
    return {int(key.split("/")[2]) for key, _ in client.key_value_dir_get_bytes(prefix + "/")
            if key.split("/")[2].isdigit()}


def test_messages_in_order_and_read_groups_deleted(clients):
    leader = LeaderChannel(clients[0], num_processes=3)
    fast, slow = FollowerChannel(clients[1], 1), FollowerChannel(clients[2], 2)
    assert fast.receive(0.05) is None  # nothing sent yet: the wait ends
    for n in range(3 * GROUP):
        leader.send(f"m{n}".encode())
    assert [fast.receive(5) for _ in range(3 * GROUP)] == [f"m{n}".encode() for n in range(3 * GROUP)]
    assert [slow.receive(5) for _ in range(GROUP + 5)] == [f"m{n}".encode() for n in range(GROUP + 5)]
    assert stored_groups(clients[0]) == {0, 1, 2}  # nothing deleted before a send checks
    for n in range(3 * GROUP, 4 * GROUP):  # the send that completes group 3 deletes what both read
        leader.send(f"m{n}".encode())
    assert stored_groups(clients[0]) == {1, 2, 3}  # group 1 still unread by the slow follower
    assert [slow.receive(5) for _ in range(4 * GROUP - (GROUP + 5))] == \
        [f"m{n}".encode() for n in range(GROUP + 5, 4 * GROUP)]
    assert fast.receive(0.05) == b"m" + str(3 * GROUP).encode()
    assert slow.receive(0.05) is None


def test_a_follower_waits_for_the_next_message(clients):
    leader, follower = LeaderChannel(clients[0], num_processes=3), FollowerChannel(clients[1], 1)
    got = []
    reader = threading.Thread(target=lambda: got.append(follower.receive(30)))
    reader.start()
    leader.send(b"late")
    reader.join(30)
    assert got == [b"late"]


def test_process_zero_does_not_follow(clients):
    with pytest.raises(ValueError, match="process 0 is the leader"):
        FollowerChannel(clients[0], 0)
