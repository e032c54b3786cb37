"""One engine whose mesh spans several hosts, started by Ray: a placement group of one bundle per
host (`placement`), one actor per bundle, `jax.distributed.initialize` from the placement.

`HostGroup` reserves the hosts (``STRICT_SPREAD``, or a whole TPU slice through `ray.util.tpu`),
starts a `HostWorker` in each bundle and asks the first for its address (the coordinator: its
node's IP and a free port there); each worker then starts JAX with ``num_processes=num_hosts`` and
its bundle index as ``process_id``, so no address is written by hand. On it:

- `MultiHostLLM(model, num_hosts=4, resources_per_host={"TPU": 4}, tensor_parallel_size=16, ...)`:
  offline. Each actor builds the same `LLM` over the global mesh and `generate` sends the batch to
  all of them (the multi-controller model of ``scripts/multihost_generate.py``: every process runs
  the same scheduler on the same calls) and returns the first one's outputs.
- `MultiHostReplicaServer`: serving (``jpaged-serve --distributed_executor ray
  --num_hosts_per_replica N``). Worker 0 is the leader of `multihost_replica` (the OpenAI app
  over a `mirrored_engine.LeaderEngine`), the others its followers; a Serve replica
  (`jpaged.serve.ray.EngineReplica`) holds it and hands each request to the leader's app, its
  answer streamed back part by part (a Ray streaming call).

On one machine (tests), ``local_devices=N`` gives each actor N CPU devices (``XLA_FLAGS``) and CPU
collectives over gloo, and ``strategy="PACK"`` lets the bundles share the node.
"""
import asyncio
import os
import secrets
import threading

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from jpaged.serve.placement import HostPlacement, host_placement


@ray.remote
class HostWorker:
    """One host's process of the engine: offline (`start`, `generate`) or a replica's leader or follower."""

    def __init__(self, num_processes: int, process_id: int, cpu_collectives: bool):
        self.num_processes, self.process_id, self.cpu_collectives = num_processes, process_id, cpu_collectives
        self.llm = self.leader = self.server = self.follower = None
        self.follower_thread = None
        self.follower_error: BaseException | None = None

    def coordinator_address(self) -> str:
        """This node's IP and a port free on it, for process 0's coordinator."""
        import socket

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"{ray.util.get_node_ip_address()}:{port}"

    def _join(self, coordinator: str) -> None:
        from jpaged.serve.multihost_replica import join

        join(coordinator, self.num_processes, self.process_id, cpu_collectives=self.cpu_collectives)

    def _placement(self) -> dict:
        import jax

        return {"process_index": jax.process_index(), "local_devices": jax.local_device_count(),
                "devices": jax.device_count(), "pid": os.getpid()}

    # Offline ------------------------------------------------------------------------------------------
    def start(self, coordinator: str, model, engine_kwargs: dict) -> dict:
        import jax

        self._join(coordinator)
        from jpaged import LLM

        kwargs = dict(engine_kwargs)
        kwargs.setdefault("tensor_parallel_size", jax.device_count())
        self.llm = LLM(model, **kwargs)
        return {**self._placement(), "mesh": dict(self.llm.llm_engine.mesh.shape)}

    def generate(self, prompts, params) -> list:
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        return [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in outs]

    # Serving ------------------------------------------------------------------------------------------
    def start_leader(self, coordinator: str, options: dict) -> dict:
        """Builds the leader's engine and OpenAI app (while the followers build theirs)."""
        from jpaged.serve.multihost_replica import leader_engine
        from jpaged.serve.replica import EngineReplicaServer

        self._join(coordinator)
        self.leader = leader_engine(options)
        self.server = EngineReplicaServer(options, engine=self.leader)
        return {**self._placement(), "mesh": dict(self.leader.mesh.shape)}

    def start_follower(self, coordinator: str, options: dict) -> dict:
        """Builds this follower's engine, then follows the leader on a thread of its own."""
        from jpaged.serve.multihost_replica import Follower

        self._join(coordinator)
        self.follower = Follower(options)

        def run():
            try:
                self.follower.run()
            except BaseException as e:  # noqa: BLE001 -- check_health reports it
                self.follower_error = e

        self.follower_thread = threading.Thread(target=run, name="jpaged-follower", daemon=True)
        self.follower_thread.start()
        return {**self._placement(), "mesh": dict(self.follower.engine.mesh.shape)}

    async def stream(self, method: str, path: str, query: bytes, headers: list, body: bytes):
        async for part in self.server.stream(method, path, query, headers, body):
            yield part

    async def report(self) -> dict:
        return await self.server.report()

    def pid(self) -> int:
        return os.getpid()

    async def check_health(self) -> None:
        if self.server is not None:
            await self.server.check_health()
        elif self.follower_error is not None:
            raise RuntimeError(f"the follower stopped: {self.follower_error!r}")
        elif self.follower_thread is not None and not self.follower_thread.is_alive() and not self.follower.stopped:
            raise RuntimeError("the follower stopped")

    async def engine_state(self) -> dict:
        """This host's placement and what its scheduler holds: every host's is the same once the
        followers ran what the leader did (a follower's is read from this thread, between its steps)."""
        def read(engine) -> dict:
            pool = engine.kv_cache.pool
            return {"requests": sorted(list(engine.requests)), "num_free_blocks": pool.num_free_blocks,
                    "cached": sorted(list(pool.cached.items()))}

        if self.server is not None:
            state = await asyncio.wrap_future(self.server.engine.call(lambda: read(self.leader)))
            mesh = self.leader.mesh
        else:
            state, mesh = read(self.follower.engine), self.follower.engine.mesh
        return {**self._placement(), **state, "mesh": dict(mesh.shape),
                "following": self.follower_thread is not None and self.follower_thread.is_alive()}

    def shutdown(self, timeout: float = 30.0) -> None:
        """A leader stops its engine and its followers; a follower waits for that (``timeout``)."""
        import jax

        if self.server is not None:
            self.server.shutdown()
            self.leader.close()
        if self.follower_thread is not None:
            self.follower_thread.join(timeout)
            self.follower.stop()
            self.follower_thread.join(timeout)
        self.llm = None
        jax.distributed.shutdown()


class HostGroup:
    """``placement.num_hosts`` `HostWorker` actors, one in each bundle, and the first one's address."""

    def __init__(self, placement: HostPlacement, *, local_devices: int | None = None, ready_timeout: float = 600.0):
        self.workers = []
        self.reserved = placement.reserve()
        try:
            self.reserved.wait(ready_timeout)
            # one hash seed for all: their prefix caches (salted roots hash strings) decide alike, and
            # agree with the gateway's router (the Serve app's seed, in this process's environment)
            env = {"PYTHONHASHSEED": os.environ.get("PYTHONHASHSEED") or str(secrets.randbelow(2**32))}
            if local_devices is not None:
                env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={local_devices}")
            n = placement.num_hosts
            for i, bundle in enumerate(placement.bundles):
                resources = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}
                self.workers.append(HostWorker.options(
                    num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0), resources=resources,
                    runtime_env={"env_vars": env},
                    scheduling_strategy=PlacementGroupSchedulingStrategy(self.reserved.group,
                                                                         placement_group_bundle_index=i),
                ).remote(n, i, local_devices is not None))
            self.coordinator = ray.get(self.workers[0].coordinator_address.remote(), timeout=ready_timeout)
        except BaseException:
            self.shutdown()
            raise

    def shutdown(self) -> None:
        for w in self.workers:
            ray.kill(w)
        self.workers = []
        self.reserved.release()


class MultiHostLLM:
    """An `LLM` over ``num_hosts`` Ray actors, one per host (see the module docstring).

    Args:
      model: what `LLM` takes (a checkpoint directory reachable from every host, a preset).
      num_hosts: processes (hosts) of the mesh (None with ``tpu_topology``: the slice's).
      resources_per_host: each bundle's Ray resources besides one CPU, e.g. ``{"TPU": 4}``.
      tpu_topology: reserve a whole TPU slice (``"v6e:4x4"``) with `ray.util.tpu` (`placement`).
      local_devices: CPU devices per actor (one-machine runs); None: the host's own devices.
      strategy: the placement group's (``STRICT_SPREAD`` on a cluster, ``PACK`` on one machine).
      engine_kwargs: `LLM` settings; ``tensor_parallel_size`` defaults to every device of every host.
    """

    def __init__(self, model, *, num_hosts: int | None = None, resources_per_host: dict | None = None,
                 tpu_topology: str | None = None, local_devices: int | None = None, strategy: str = "STRICT_SPREAD",
                 ready_timeout: float = 600.0, **engine_kwargs):
        if num_hosts is None:
            if tpu_topology is None:
                raise ValueError("num_hosts: needed without tpu_topology")
            from jpaged.serve.placement import slice_num_hosts

            num_hosts = slice_num_hosts(tpu_topology)
        placement = host_placement(num_hosts, resources_per_host, tpu_topology=tpu_topology, strategy=strategy)
        self.hosts = HostGroup(placement, local_devices=local_devices, ready_timeout=ready_timeout)
        self.workers = self.hosts.workers
        try:
            self.placement = ray.get([w.start.remote(self.hosts.coordinator, model, engine_kwargs)
                                      for w in self.workers], timeout=ready_timeout)
        except BaseException:
            self.shutdown()
            raise

    def generate(self, prompts, params, timeout: float | None = None) -> list:
        """Per prompt, per choice ``(token_ids, text, finish_reason)``: every host runs the batch,
        the first host's outputs are returned (they are all the same)."""
        return ray.get([w.generate.remote(prompts, params) for w in self.workers], timeout=timeout)[0]

    def shutdown(self) -> None:
        self.hosts.shutdown()
        self.workers = []


class MultiHostReplicaServer:
    """A Serve replica's engine spanning hosts: what `jpaged.serve.replica.EngineReplicaServer` is
    for one host (`stream`, `report`, `check_health`, `shutdown`), over a `HostGroup` whose first
    worker leads.

    Args:
      options: `jpaged.entrypoints.serve.server_options`' dict; ``tensor_parallel_size`` defaults
        to every device of every host.
      placement: the hosts (`placement.host_placement`).
      local_devices: CPU devices per host process (one-machine runs).
    """

    def __init__(self, options: dict, placement: HostPlacement, *, local_devices: int | None = None,
                 ready_timeout: float = 1800.0, health_timeout: float = 30.0):
        self.health_timeout = health_timeout
        self.hosts = HostGroup(placement, local_devices=local_devices, ready_timeout=ready_timeout)
        self.leader, *self.followers = self.hosts.workers
        coordinator = self.hosts.coordinator
        try:
            self.placement = ray.get([self.leader.start_leader.remote(coordinator, options)]
                                     + [f.start_follower.remote(coordinator, options) for f in self.followers],
                                     timeout=ready_timeout)
        except BaseException:
            self.hosts.shutdown()
            raise

    async def stream(self, method: str, path: str, query: bytes, headers: list, body: bytes):
        """The leader's `call_asgi` parts; closing this early cancels the call there (the client left:
        the app aborts its requests)."""
        parts = self.leader.stream.options(num_returns="streaming").remote(method, path, query, headers, body)
        try:
            async for ref in parts:
                yield await ref
        finally:
            ray.cancel(parts)

    async def report(self) -> dict:
        return await self.leader.report.remote()

    def pid(self) -> int:
        """The leader's process."""
        return ray.get(self.leader.pid.remote(), timeout=self.health_timeout)

    async def engine_states(self) -> list[dict]:
        """Each host's `HostWorker.engine_state`, leader first."""
        return list(await asyncio.gather(*(w.engine_state.remote() for w in self.hosts.workers)))

    async def check_health(self) -> None:
        """Raises when a host's process died, its engine or its follower loop stopped."""
        await asyncio.wait_for(asyncio.gather(*(w.check_health.remote() for w in self.hosts.workers)),
                               self.health_timeout)

    def shutdown(self, timeout: float = 60.0) -> None:
        """Stops the leader's engine and its followers, then ends the actors and frees the hosts."""
        try:
            ray.get([w.shutdown.remote() for w in self.hosts.workers], timeout=timeout)
        except Exception:  # noqa: BLE001 -- a dead host: the actors are killed all the same
            pass
        self.hosts.shutdown()
