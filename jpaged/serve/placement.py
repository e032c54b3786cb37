"""Where the hosts of an engine spanning hosts go on a Ray cluster: one placement-group bundle per
host, bundle i for JAX's process i.

`host_placement` builds the request as plain data (`HostPlacement`); `HostPlacement.reserve` asks
Ray for it:

- a TPU slice (``tpu_topology="v6e:4x4"``): the hosts of one whole slice, with
  `ray.util.tpu.slice_placement_group`. Ray first claims the slice's head resource
  (``TPU-v6e-16-head``, held by its worker 0) to learn the slice's name, then places one bundle
  per host (``{"CPU": c, "TPU": chips per host}``) with that name as every bundle's label
  selector (``ray.io/tpu-slice-name``), so all of them land on that one slice, whose chips are
  connected by ICI. jpaged adds ``ray.io/tpu-worker-id`` = the bundle's index to each selector:
  JAX's process i runs on the slice's worker i.
- anything else (CPU, GPU): plain bundles ``{"CPU": c, "GPU": g}``, ``STRICT_SPREAD`` (one per
  node; ``PACK`` lets a one-machine test put them together).

A replica's resources (``--num_cpus_per_replica`` ...) are split evenly over its hosts
(`resources_per_host`).
"""
from dataclasses import dataclass

TPU_WORKER_ID_LABEL = "ray.io/tpu-worker-id"  # the label Ray gives each TPU VM of a slice: its worker index


@dataclass(frozen=True)
class HostPlacement:
    """The placement request of one engine's hosts."""

    bundles: tuple  # one resource dict per host
    strategy: str
    bundle_label_selector: tuple | None = None  # one label dict per bundle (TPU slices)
    tpu_version: str | None = None   # e.g. "v6e": reserve a whole slice of this topology
    tpu_topology: str | None = None  # e.g. "4x4"

    @property
    def num_hosts(self) -> int:
        return len(self.bundles)

    def reserve(self, name: str = "") -> "ReservedPlacement":
        """Asks Ray for the bundles (Ray must be initialized); wait with `ReservedPlacement.wait`."""
        if self.tpu_topology is not None:
            from ray.util.tpu import slice_placement_group

            selectors = [dict(s) for s in self.bundle_label_selector] if self.bundle_label_selector else None
            handle = slice_placement_group(self.tpu_topology, self.tpu_version,
                                           resources_per_bundle=dict(self.bundles[0]), strategy=self.strategy,
                                           name=name, bundle_label_selector=selectors)
            return ReservedPlacement(handle.placement_group, handle.shutdown, handle.release_head_pgs)
        from ray.util.placement_group import placement_group, remove_placement_group

        group = placement_group([dict(b) for b in self.bundles], strategy=self.strategy, name=name)
        return ReservedPlacement(group, lambda: remove_placement_group(group))


class ReservedPlacement:
    """A placement group asked for: `wait` until Ray placed it, `release` it at the end."""

    def __init__(self, group, release, on_ready=None):
        self.group, self._release, self._on_ready = group, release, on_ready

    def wait(self, timeout: float) -> None:
        import ray

        ray.get(self.group.ready(), timeout=timeout)
        if self._on_ready is not None:  # a slice's head claim: the bundles hold the slice now
            self._on_ready()

    def release(self) -> None:
        self._release()


def split_tpu_topology(tpu_topology: str) -> tuple[str, str]:
    """``"v6e:4x4"`` -> ``("v6e", "4x4")``."""
    version, sep, topology = tpu_topology.partition(":")
    if not sep or not version or not topology:
        raise ValueError(f"tpu_topology={tpu_topology!r}: expected VERSION:TOPOLOGY, e.g. v6e:4x4")
    return version.strip().lower(), topology.strip().lower()


def slice_num_hosts(tpu_topology: str) -> int:
    """The hosts of a TPU slice (``"v6e:4x4"`` -> 4): Ray's count of its VMs."""
    from ray.util.tpu import get_tpu_worker_resources

    version, topology = split_tpu_topology(tpu_topology)
    return get_tpu_worker_resources(topology, version)[0]


def resources_per_host(num_hosts: int, *, num_cpus: float = 1.0, num_gpus: float = 0.0,
                       num_tpus: float = 0.0) -> dict:
    """A replica's resources (totals) split evenly over its hosts; GPUs and TPU chips in whole numbers."""
    def share(total, name, whole):
        value = total / num_hosts
        if whole and value != int(value):
            raise ValueError(f"{name}={total:g}: not a whole number per host over {num_hosts} hosts")
        return int(value) if whole else value

    bundle = {"CPU": share(num_cpus, "num_cpus", whole=False)}
    if num_gpus:
        bundle["GPU"] = share(num_gpus, "num_gpus", whole=True)
    if num_tpus:
        bundle["TPU"] = share(num_tpus, "num_tpus", whole=True)
    return bundle


def host_placement(num_hosts: int, resources: dict | None = None, *, tpu_topology: str | None = None,
                   strategy: str = "STRICT_SPREAD") -> HostPlacement:
    """The placement of one engine's ``num_hosts`` hosts, each with ``resources`` (default one CPU).

    With ``tpu_topology`` the hosts are one slice's: ``num_hosts`` must be the slice's, and the
    TPU chips per host (default: all of the host's) must divide the slice.
    """
    if num_hosts < 1:
        raise ValueError(f"num_hosts={num_hosts}: must be >= 1")
    resources = {"CPU": 1, **(resources or {})}
    if tpu_topology is None:
        return HostPlacement(tuple(dict(resources) for _ in range(num_hosts)), strategy)
    if resources.get("GPU"):
        raise ValueError("GPU: a TPU slice's hosts have no GPUs")
    from ray.util.tpu import get_tpu_worker_resources

    version, topology = split_tpu_topology(tpu_topology)
    workers, bundle = get_tpu_worker_resources(topology, version, resources_per_worker=resources)
    if workers != num_hosts:
        raise ValueError(f"num_hosts={num_hosts}: a {version} {topology} slice in bundles of {bundle['TPU']:g} "
                         f"chips is {workers} hosts")
    selectors = tuple({TPU_WORKER_ID_LABEL: str(i)} for i in range(num_hosts)) if num_hosts > 1 else None
    return HostPlacement(tuple(dict(bundle) for _ in range(num_hosts)), strategy, selectors, version, topology)
