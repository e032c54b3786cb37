"""A replica whose engine spans hosts: one process per host, joined with `jax.distributed`. Process 0,
the leader, serves the OpenAI app over a `mirrored_engine.LeaderEngine`; the others, the followers,
run its engine calls and serve nothing (`mirrored_engine` says why and how).

Who starts the processes:

- Ray: `ray_multihost.MultiHostReplicaServer` (``jpaged-serve --distributed_executor ray
  --num_hosts_per_replica N``), one actor per host of its placement, behind the Ray Serve gateway.
- anything that runs one ``jpaged-serve --distributed_executor jax`` per host (`run_process`): the
  pods of a Kubernetes LeaderWorkerSet, where ``--coordinator_address``, ``--num_processes`` and
  ``--process_id`` default to the leader pod's address (``LWS_LEADER_ADDRESS``, port
  `COORDINATOR_PORT`), ``LWS_GROUP_SIZE`` and ``LWS_WORKER_INDEX`` (`lws_defaults`).

``tensor_parallel_size`` defaults to every device of every process. With ``JAX_PLATFORMS=cpu`` the
processes' CPU devices talk over gloo (one-machine runs).
"""
import os
import signal
import threading

from jpaged.logger import logger

COORDINATOR_PORT = 8476  # the leader's jax.distributed coordinator (JAX's own default port on TPU VMs)


def lws_defaults(environ=os.environ) -> dict:
    """``coordinator_address``, ``num_processes``, ``process_id`` from a LeaderWorkerSet pod's
    environment (None where its variable is not set)."""
    leader = environ.get("LWS_LEADER_ADDRESS")
    size, index = environ.get("LWS_GROUP_SIZE"), environ.get("LWS_WORKER_INDEX")
    return {"coordinator_address": f"{leader}:{COORDINATOR_PORT}" if leader else None,
            "num_processes": int(size) if size else None, "process_id": int(index) if index else None}


def join(coordinator: str, num_processes: int, process_id: int, *, cpu_collectives: bool | None = None) -> None:
    """`jax.distributed.initialize` (CPU collectives over gloo with ``cpu_collectives``, default:
    when ``JAX_PLATFORMS`` is ``cpu``)."""
    import jax

    if cpu_collectives is None:
        cpu_collectives = os.environ.get("JAX_PLATFORMS") == "cpu"
    if cpu_collectives:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id)


def mesh_options(options: dict) -> dict:
    """``options`` with ``tensor_parallel_size`` defaulting to every device of every process."""
    import jax

    engine_kwargs = {"tensor_parallel_size": jax.device_count(), **options["engine_kwargs"]}
    if engine_kwargs.get("data_parallel_size", 1) != 1:
        raise ValueError("data_parallel_size: an engine spanning hosts is one replica (run more replicas instead)")
    return {**options, "engine_kwargs": engine_kwargs}


def leader_engine(options: dict):
    """Process 0's engine (built with the followers' at the same time), sending their calls."""
    import jax

    from jpaged.entrypoints.server_app import engine_from_options
    from jpaged.serve.call_channel import LeaderChannel, coordination_client
    from jpaged.serve.mirrored_engine import LeaderEngine

    if jax.process_index() != 0:
        raise RuntimeError(f"process {jax.process_index()}: only process 0 leads")
    return LeaderEngine(engine_from_options(mesh_options(options)), LeaderChannel(coordination_client(),
                                                                                  jax.process_count()))


class Follower:
    """A follower's engine and its end of the leader's calls; `run` follows until the leader stops."""

    def __init__(self, options: dict):
        import jax

        from jpaged.entrypoints.server_app import engine_from_options
        from jpaged.serve.call_channel import FollowerChannel, coordination_client

        self.engine = engine_from_options(mesh_options(options))
        self.channel = FollowerChannel(coordination_client(), jax.process_index())
        self._stop = threading.Event()
        self.stopped = False  # the leader said stop, or `stop` was called

    def run(self) -> int:
        """Follows the leader; returns the steps run."""
        from jpaged.serve.mirrored_engine import follow

        steps = follow(self.engine, self.channel, self._stop)
        self.stopped = True
        logger.info("follower %d: stopped after %d steps", self.channel.process_id, steps)
        return steps

    def stop(self) -> None:
        self._stop.set()


def run_process(options: dict, *, coordinator: str, num_processes: int, process_id: int, host: str, port: int,
                log_level: str = "info") -> None:
    """``jpaged-serve --distributed_executor jax``: process 0 serves on ``host:port`` until SIGTERM
    (drained as one-host serving is), then stops the followers; a follower follows until then (or
    its own SIGTERM). Both leave `jax.distributed` at the end."""
    import jax

    from jpaged.entrypoints.server_app import app_from_options, draining_server

    for name, value in (("coordinator_address", coordinator), ("num_processes", num_processes),
                        ("process_id", process_id)):
        if value is None:
            raise ValueError(f"--{name}: needed with --distributed_executor jax (or the LWS_* environment)")
    join(coordinator, num_processes, process_id)
    try:
        if process_id == 0:
            leader = leader_engine(options)
            try:
                draining_server(app_from_options(options, leader), shutdown_timeout=options.get("shutdown_timeout", 10.0),
                                host=host, port=port, log_level=log_level).run()
            finally:
                leader.close()
        else:
            follower = Follower(options)
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: follower.stop())
            logger.info("follower %d of %d: following the leader at %s", process_id, num_processes, coordinator)
            follower.run()
    finally:
        jax.distributed.shutdown()
