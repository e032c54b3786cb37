"""One engine whose mesh spans several hosts, started by Ray: a placement group of one bundle per
host, one actor per bundle, `jax.distributed.initialize` from the placement.

``MultiHostLLM(model, num_hosts=4, resources_per_host={"TPU": 4}, tensor_parallel_size=16, ...)``
reserves the hosts (``STRICT_SPREAD``: one bundle per node), asks the first actor for its address
(the coordinator: its node's IP and a free port there), and starts every actor's JAX with
``num_processes=num_hosts`` and its bundle index as ``process_id``; no address is written by hand.
Each actor then builds the same `LLM` over the global mesh. This is the multi-controller model of
``scripts/multihost_generate.py``: every process runs the same scheduler on the same calls, so
`generate` sends the batch to all of them and returns the first one's outputs.

On one machine (tests), ``local_devices=N`` gives each actor N CPU devices (``XLA_FLAGS``) and CPU
collectives over gloo, and ``strategy="PACK"`` lets the bundles share the node.
"""
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy


@ray.remote
class HostWorker:
    """One host's process of the engine."""

    def __init__(self, num_processes: int, process_id: int, cpu_collectives: bool):
        self.num_processes, self.process_id, self.cpu_collectives = num_processes, process_id, cpu_collectives
        self.llm = None

    def coordinator_address(self) -> str:
        """This node's IP and a port free on it, for process 0's coordinator."""
        import socket

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"{ray.util.get_node_ip_address()}:{port}"

    def start(self, coordinator: str, model, engine_kwargs: dict) -> dict:
        import jax

        if self.cpu_collectives:
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator, num_processes=self.num_processes, process_id=self.process_id)
        from jpaged import LLM

        kwargs = dict(engine_kwargs)
        kwargs.setdefault("tensor_parallel_size", jax.device_count())
        self.llm = LLM(model, **kwargs)
        return {"process_index": jax.process_index(), "local_devices": jax.local_device_count(),
                "devices": jax.device_count(), "mesh": dict(self.llm.llm_engine.mesh.shape)}

    def generate(self, prompts, params) -> list:
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        return [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in outs]

    def shutdown(self) -> None:
        import jax

        self.llm = None
        jax.distributed.shutdown()


class MultiHostLLM:
    """An `LLM` over ``num_hosts`` Ray actors, one per host (see the module docstring).

    Args:
      model: what `LLM` takes (a checkpoint directory reachable from every host, a preset).
      num_hosts: processes (hosts) of the mesh.
      resources_per_host: each bundle's Ray resources besides one CPU, e.g. ``{"TPU": 4}``.
      local_devices: CPU devices per actor (one-machine runs); None: the host's own devices.
      strategy: the placement group's (``STRICT_SPREAD`` on a cluster, ``PACK`` on one machine).
      engine_kwargs: `LLM` settings; ``tensor_parallel_size`` defaults to every device of every host.
    """

    def __init__(self, model, *, num_hosts: int, resources_per_host: dict | None = None,
                 local_devices: int | None = None, strategy: str = "STRICT_SPREAD", ready_timeout: float = 600.0,
                 **engine_kwargs):
        if num_hosts < 1:
            raise ValueError(f"num_hosts={num_hosts}: must be >= 1")
        bundle = {"CPU": 1, **(resources_per_host or {})}
        self.group = placement_group([dict(bundle) for _ in range(num_hosts)], strategy=strategy)
        try:
            ray.get(self.group.ready(), timeout=ready_timeout)
            env = {}
            if local_devices is not None:
                env = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={local_devices}"}
            self.workers = [HostWorker.options(
                num_cpus=1, resources=resources_per_host or {}, runtime_env={"env_vars": env},
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=i),
            ).remote(num_hosts, i, local_devices is not None) for i in range(num_hosts)]
            coordinator = ray.get(self.workers[0].coordinator_address.remote(), timeout=ready_timeout)
            self.placement = ray.get([w.start.remote(coordinator, model, engine_kwargs) for w in self.workers],
                                     timeout=ready_timeout)
        except BaseException:
            self.shutdown()
            raise

    def generate(self, prompts, params, timeout: float | None = None) -> list:
        """Per prompt, per choice ``(token_ids, text, finish_reason)``: every host runs the batch,
        the first host's outputs are returned (they are all the same)."""
        return ray.get([w.generate.remote(prompts, params) for w in self.workers], timeout=timeout)[0]

    def shutdown(self) -> None:
        for w in getattr(self, "workers", []):
            ray.kill(w)
        self.workers = []
        remove_placement_group(self.group)
