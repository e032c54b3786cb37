"""`placement`: the placement request of an engine's hosts, as data. A TPU slice goes through
`ray.util.tpu`'s own `SlicePlacementGroup` code with Ray's two cluster calls replaced (claiming the
slice's head, creating a placement group), so the test sees the exact request Ray would make; no
cluster, no TPU."""
import importlib

import pytest

ray = pytest.importorskip("ray")
tpu = pytest.importorskip("ray.util.tpu")
ray_placement_group = importlib.import_module("ray.util.placement_group")  # the module (ray.util's name is a function)

from jpaged.serve.placement import (TPU_WORKER_ID_LABEL, host_placement, resources_per_host,  # noqa: E402
                                    slice_num_hosts)
from jpaged.serve.ray import replica_placement  # noqa: E402


class FakeGroup:
    def __init__(self, **request):
        self.request = request


@pytest.fixture
def ray_calls(monkeypatch):
    """Ray's cluster calls, recorded: placement groups created and removed, slice heads claimed."""
    calls = {"groups": [], "removed": [], "heads": []}

    def placement_group(bundles, strategy="PACK", name="", lifetime=None, bundle_label_selector=None):
        group = FakeGroup(bundles=bundles, strategy=strategy, name=name, bundle_label_selector=bundle_label_selector)
        calls["groups"].append(group)
        return group

    def reserve_tpu_slice(topology, accelerator_type, timeout_s=None, slice_name=None):
        head = FakeGroup(head=(topology, accelerator_type))
        calls["heads"].append(head)
        return "slice-a", head

    monkeypatch.setattr("ray._private.auto_init_hook.enable_auto_connect", False)  # no local Ray started for it
    monkeypatch.setattr(tpu, "placement_group", placement_group)
    monkeypatch.setattr(tpu, "reserve_tpu_slice", reserve_tpu_slice)
    monkeypatch.setattr(tpu, "remove_placement_group", calls["removed"].append)
    monkeypatch.setattr(ray_placement_group, "placement_group", placement_group)
    monkeypatch.setattr(ray_placement_group, "remove_placement_group", calls["removed"].append)
    return calls


def test_a_v6e_16_slice_is_four_hosts_pinned_to_its_workers():
    placement = host_placement(4, {"CPU": 2}, tpu_topology="v6e:4x4")
    assert placement.bundles == ({"CPU": 2, "TPU": 4},) * 4
    assert placement.bundle_label_selector == tuple({TPU_WORKER_ID_LABEL: str(i)} for i in range(4))
    assert (placement.tpu_version, placement.tpu_topology, placement.strategy) == ("v6e", "4x4", "STRICT_SPREAD")
    assert slice_num_hosts("v6e:4x4") == 4 and slice_num_hosts("v5p:2x4x4") == 8 and slice_num_hosts("v6e:2x4") == 1


def test_slice_reservation_is_the_request_ray_makes(ray_calls):
    reserved = host_placement(4, tpu_topology="v6e:4x4").reserve(name="jpaged-replica-0")
    [head] = ray_calls["heads"]
    assert head.request == {"head": ("4x4", "TPU-V6E")}  # the slice's worker 0 claimed first (TPU-v6e-16-head)
    [group] = ray_calls["groups"]
    assert reserved.group is group
    assert group.request == {
        "bundles": [{"CPU": 1, "TPU": 4}] * 4, "strategy": "STRICT_SPREAD", "name": "jpaged-replica-0",
        "bundle_label_selector": [{TPU_WORKER_ID_LABEL: str(i), "ray.io/tpu-slice-name": "slice-a"} for i in range(4)]}
    reserved.release()
    assert ray_calls["removed"] == [group, head]
    assert not ray.is_initialized()


def test_cpu_and_gpu_hosts_are_plain_bundles(ray_calls):
    placement = host_placement(2, resources_per_host(2, num_cpus=2, num_gpus=4), strategy="PACK")
    assert placement.bundles == ({"CPU": 1.0, "GPU": 2},) * 2
    assert placement.bundle_label_selector is None and placement.tpu_topology is None
    reserved = placement.reserve()
    [group] = ray_calls["groups"]
    assert group.request == {"bundles": [{"CPU": 1.0, "GPU": 2}] * 2, "strategy": "PACK", "name": "",
                             "bundle_label_selector": None}
    reserved.release()
    assert ray_calls["removed"] == [group] and not ray_calls["heads"]


def test_a_replicas_hosts_from_the_serving_flags():
    assert replica_placement(None, None, num_cpus=1, num_gpus=0, num_tpus=0) is None  # one host: in the Serve actor
    assert replica_placement(1, None, num_cpus=1, num_gpus=1, num_tpus=0) is None
    tpu_hosts = replica_placement(None, "v6e:4x4", num_cpus=4, num_gpus=0, num_tpus=16)
    assert tpu_hosts.bundles == ({"CPU": 1.0, "TPU": 4},) * 4 and tpu_hosts.tpu_topology == "4x4"
    gpu_hosts = replica_placement(2, None, num_cpus=2, num_gpus=16, num_tpus=0)
    assert gpu_hosts.bundles == ({"CPU": 1.0, "GPU": 8},) * 2


@pytest.mark.parametrize("call, match", [
    (lambda: host_placement(2, tpu_topology="v6e:4x4"), "slice in bundles of 4 chips is 4 hosts"),
    (lambda: host_placement(4, {"TPU": 8}, tpu_topology="v6e:4x4"), "is 2 hosts"),
    (lambda: host_placement(4, {"GPU": 1}, tpu_topology="v6e:4x4"), "no GPUs"),
    (lambda: host_placement(4, tpu_topology="4x4"), "VERSION:TOPOLOGY"),
    (lambda: resources_per_host(4, num_tpus=6), "not a whole number per host"),
    (lambda: host_placement(0), "must be >= 1"),
])
def test_placements_that_cannot_be(call, match):
    with pytest.raises(ValueError, match=match):
        call()
