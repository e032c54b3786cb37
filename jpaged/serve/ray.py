"""The OpenAI server as a Ray Serve application: N engine replicas behind a KV-cache-aware gateway.

``build_app(options, num_replicas=2, routing="prefix")`` returns the application to give
``serve.run``; ``jpaged-serve --distributed_executor ray --num_replicas N`` runs it. ``options`` are
`jpaged.entrypoints.serve.server_options`' (the same settings as ``scripts/serve.py``): every
replica is that server (`replica.EngineReplicaServer`), on its own devices (``num_gpus`` /
``num_tpus`` / ``num_cpus`` per replica: Ray gives each actor its own accelerators), and the
gateway (`gateway.Gateway`) in front answers HTTP with the same routes, limits and API key.

Each replica is its own Serve deployment of one replica (``jpaged-replica-<i>``): the gateway
chooses the replica itself (`routing.Router`), and Serve restarts a replica whose process dies.
Every actor of the app shares one ``PYTHONHASHSEED`` so that salted prefix hashes agree.
"""
import secrets

from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from jpaged.serve.gateway import Gateway, ReplicaUnavailable, create_gateway_app
from jpaged.serve.replica import EngineReplicaServer
from jpaged.serve.routing import POLICIES, Router

REPLICA_GONE = (RayActorError, ActorDiedError, ActorUnavailableError)


class EngineReplica:
    """A Serve replica holding one engine and its OpenAI app: in this actor, or with a ``placement``
    of several hosts on its own actors (`ray_multihost.MultiHostReplicaServer`)."""

    def __init__(self, options: dict, placement=None, local_devices: int | None = None):
        if placement is None:
            self.server = EngineReplicaServer(options)
        else:
            from jpaged.serve.ray_multihost import MultiHostReplicaServer

            self.server = MultiHostReplicaServer(options, placement, local_devices=local_devices)

    async def stream(self, method: str, path: str, query: bytes, headers: list, body: bytes):
        async for part in self.server.stream(method, path, query, headers, body):
            yield part

    async def report(self) -> dict:
        return await self.server.report()

    def pid(self) -> int:
        return self.server.pid()

    async def check_health(self) -> None:
        await self.server.check_health()

    async def engine_states(self) -> list[dict]:
        """Each host's placement and scheduler state, leader first (a replica spanning hosts)."""
        if not hasattr(self.server, "engine_states"):
            raise ValueError("engine_states: this replica's engine is on one host")
        return await self.server.engine_states()

    def __del__(self):
        server = getattr(self, "server", None)
        if server is not None:
            server.shutdown()


class RayReplicaClient:
    """A `gateway.ReplicaClient` over a replica deployment's handle."""

    def __init__(self, name: str, handle):
        self.name, self.handle = name, handle

    async def stream(self, method, path, query, headers, body):
        parts = self.handle.options(stream=True).stream.remote(method, path, query, headers, body)
        try:
            async for part in parts:
                yield part
        except REPLICA_GONE as e:
            raise ReplicaUnavailable(f"replica {self.name}: {type(e).__name__}") from e
        finally:
            parts.cancel()

    async def report(self) -> dict:
        try:
            return await self.handle.report.remote()
        except REPLICA_GONE as e:
            raise ReplicaUnavailable(f"replica {self.name}: {type(e).__name__}") from e


def router_tokenizer(model: str | None):
    """The tokenizer the gateway routes text prompts with: a checkpoint directory's (None for other
    sources: their text prompts are routed by load, token-id prompts still by prefix)."""
    import os

    from jpaged.loading.hf_checkpoint import load_tokenizer

    return load_tokenizer(model) if model and os.path.isdir(model) else None


@serve.ingress()
class GatewayDeployment:
    """The HTTP front (Serve's ingress): a `Gateway` over the replica deployments' handles."""

    def __init__(self, *handles, options: dict, routing: str, poll_interval: float):
        from jpaged.entrypoints.server_app import resolve_chat_template

        clients = [RayReplicaClient(f"replica-{i}", h) for i, h in enumerate(handles)]
        self.gateway = Gateway(clients, Router([c.name for c in clients], routing),
                               tokenizer=router_tokenizer(options["model"]),
                               chat_template=resolve_chat_template(options["chat_template"]),
                               max_body_bytes=options["max_request_body_bytes"], poll_interval=poll_interval)
        self.asgi_app = create_gateway_app(self.gateway, api_key=options["api_key"])

    def __serve_build_asgi_app__(self):
        return self.asgi_app


def replica_placement(num_hosts: int | None, tpu_topology: str | None, *, num_cpus: float, num_gpus: float,
                      num_tpus: float, strategy: str = "STRICT_SPREAD"):
    """The hosts of one replica (`placement.HostPlacement`), or None for a one-host replica (it
    runs in its Serve actor). ``num_hosts`` None: the TPU slice's, else 1."""
    from jpaged.serve.placement import host_placement, resources_per_host, slice_num_hosts

    if num_hosts is None:
        num_hosts = slice_num_hosts(tpu_topology) if tpu_topology else 1
    if num_hosts == 1 and tpu_topology is None:
        return None
    return host_placement(num_hosts, resources_per_host(num_hosts, num_cpus=num_cpus, num_gpus=num_gpus,
                                                        num_tpus=num_tpus),
                          tpu_topology=tpu_topology, strategy=strategy)


def build_app(options: dict, *, num_replicas: int = 1, routing: str = "prefix", num_cpus: float = 1.0,
              num_gpus: float = 0.0, num_tpus: float = 0.0, num_hosts_per_replica: int | None = None,
              tpu_topology: str | None = None, placement_strategy: str = "STRICT_SPREAD",
              local_devices_per_host: int | None = None, poll_interval: float = 0.5,
              health_check_period_s: float = 2.0):
    """The Serve application (give it to ``serve.run(app, route_prefix="/")``).

    Args:
      options: `server_options()`' dict (model, engine kwargs, the server's own settings).
      num_replicas: engine replicas, each a deployment ``jpaged-replica-<i>`` of one Serve replica.
      routing: ``prefix`` (longest cached prefix, then least loaded), ``least_loaded`` or ``round_robin``.
      num_cpus, num_gpus, num_tpus: what Ray reserves for each replica (its devices are those),
        split evenly over its hosts.
      num_hosts_per_replica: hosts (processes) of each replica's engine; above 1 (or with
        ``tpu_topology``) each replica is a `ray_multihost.MultiHostReplicaServer`: one actor per
        host in a placement group (``placement_strategy``), the Serve actor in front of them.
      tpu_topology: each replica reserves a whole TPU slice, e.g. ``"v6e:4x4"`` (`placement`).
      local_devices_per_host: CPU devices per host process (one-machine runs of a multi-host replica).
    """
    if num_replicas < 1:
        raise ValueError(f"num_replicas={num_replicas}: must be >= 1")
    if routing not in POLICIES:
        raise ValueError(f"routing: {routing!r} is not one of {', '.join(POLICIES)}")
    for field, value in (("num_cpus", num_cpus), ("num_gpus", num_gpus), ("num_tpus", num_tpus)):
        if value < 0:
            raise ValueError(f"{field}={value}: must be >= 0")
    placement = replica_placement(num_hosts_per_replica, tpu_topology, num_cpus=num_cpus, num_gpus=num_gpus,
                                  num_tpus=num_tpus, strategy=placement_strategy)
    runtime_env = {"env_vars": {"PYTHONHASHSEED": str(secrets.randbelow(2**32))}}
    if placement is None:
        actor = {"num_cpus": num_cpus, "num_gpus": num_gpus, "runtime_env": runtime_env}
        if num_tpus:
            actor["resources"] = {"TPU": num_tpus}
    else:  # the front of the hosts' actors, which hold the resources
        actor = {"num_cpus": 0, "runtime_env": runtime_env}
    replica = serve.deployment(EngineReplica)
    replicas = [replica.options(name=f"jpaged-replica-{i}", num_replicas=1, ray_actor_options=actor,
                                max_ongoing_requests=100_000, health_check_period_s=health_check_period_s,
                                graceful_shutdown_timeout_s=5).bind(options, placement, local_devices_per_host)
                for i in range(num_replicas)]
    gateway = serve.deployment(GatewayDeployment).options(
        name="jpaged-gateway", num_replicas=1, max_ongoing_requests=100_000,
        ray_actor_options={"num_cpus": 0, "runtime_env": runtime_env})
    return gateway.bind(*replicas, options=options, routing=routing, poll_interval=poll_interval)


def run(options: dict, *, host: str, port: int, address: str | None = None, ready_timeout: float = 1800.0,
        **app_kwargs) -> None:
    """``jpaged-serve --distributed_executor ray``: joins (or starts) Ray, runs the app on ``host:port``
    until SIGTERM or Ctrl-C, then shuts Serve down."""
    import signal
    import threading
    import time
    import urllib.request

    import ray

    from jpaged.entrypoints.server_app import served_name
    from jpaged.logger import logger

    app = build_app(options, **app_kwargs)  # bad arguments fail before Ray starts
    ray.init(address=address, include_dashboard=False)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(app, name="jpaged", route_prefix="/", blocking=False)
        url = f"http://{host}:{port}"
        deadline = time.monotonic() + ready_timeout
        while not stop.is_set() and time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(url + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            stop.wait(1.0)
        if not stop.is_set():
            hosts = app_kwargs.get("num_hosts_per_replica") or 1
            logger.info("ready on %s (%s, %d Ray Serve replicas%s, routing %s)", url, served_name(options),
                        app_kwargs.get("num_replicas", 1), f" of {hosts} hosts" if hosts > 1 else "",
                        app_kwargs.get("routing", "prefix"))
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()
