"""configs/k8s/: the manifests `scripts/k8s_manifests.py` generates from the flagfiles are the ones
checked in, every field is one the Kubernetes API's models know (the `kubernetes` client's
``openapi_types``), with the types and required fields they give, and the server's args are valid
jpaged-serve flags. The client has no model of a LeaderWorkerSet (a CRD): its own fields are
checked against `LWS_SCHEMA`, the CRD's schema as written down below, and its pod templates
against ``V1PodTemplateSpec``."""
import glob
import os
import sys

import pytest

yaml = pytest.importorskip("yaml")
k8s = pytest.importorskip("kubernetes")
from kubernetes.client import ApiClient, models  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "scripts"))
import k8s_manifests  # noqa: E402

SCALARS = {"str": str, "int": int, "bool": bool, "float": (int, float)}


def check_model(data, type_name: str, path: str) -> None:
    """Fails on a field the model does not have or a value of the wrong type, recursively."""
    if type_name.startswith("Optional["):
        check_model(data, type_name[len("Optional["):-1], path)
    elif type_name.startswith(("List[", "list[")):
        assert isinstance(data, list), f"{path}: expected a list"
        for i, item in enumerate(data):
            check_model(item, type_name[5:-1], f"{path}[{i}]")
    elif type_name.startswith(("Dict[", "dict(")):
        assert isinstance(data, dict), f"{path}: expected a mapping"
        value_type = type_name[5:-1].split(", ", 1)[1]
        for key, value in data.items():
            assert isinstance(key, str), f"{path}: key {key!r}"
            check_model(value, value_type, f"{path}.{key}")
    elif type_name in SCALARS:
        assert isinstance(data, SCALARS[type_name]) and not (type_name != "bool" and isinstance(data, bool)), \
            f"{path}: expected {type_name}, got {data!r}"
    elif type_name == "object":  # IntOrString, Quantity, free-form
        assert isinstance(data, (str, int, float, dict, list)), f"{path}: {data!r}"
    else:
        cls = getattr(models, type_name)
        assert isinstance(data, dict), f"{path}: expected a {type_name} mapping"
        by_json = {json_name: attr for attr, json_name in cls.attribute_map.items()}
        for key, value in data.items():
            assert key in by_json, f"{path}.{key}: not a field of {type_name}"
            check_model(value, cls.openapi_types[by_json[key]], f"{path}.{key}")


# leaderworkerset.x-k8s.io/v1 LeaderWorkerSet: the CRD's openAPIV3Schema (kubernetes-sigs/lws,
# config/crd/bases/leaderworkerset.x-k8s.io_leaderworkersets.yaml) down to the pod templates, which
# are core PodTemplateSpecs. A dict is an object: its fields, and "required" (a set) among them; a
# set of strings is an enum.
LWS_SCHEMA = {
    "apiVersion": str, "kind": str, "metadata": "V1ObjectMeta",
    "spec": {
        "required": {"leaderWorkerTemplate"},
        "replicas": int, "startupPolicy": {"LeaderCreated", "LeaderReady"}, "networkConfig": dict,
        "rolloutStrategy": dict,
        "leaderWorkerTemplate": {
            "required": {"workerTemplate"},
            "size": int, "leaderTemplate": "V1PodTemplateSpec", "workerTemplate": "V1PodTemplateSpec",
            "restartPolicy": {"Default", "RecreateGroupOnPodRestart", "RecreateGroupAfterStart", "None"},
            "subGroupPolicy": dict, "volumeClaimTemplates": list, "persistentVolumeClaimRetentionPolicy": dict,
        },
    },
}


def check_schema(data, schema, path: str) -> None:
    """Fails on a field the schema does not have, a missing required one, a value of the wrong type
    or outside its enum; a model name (``"V1..."``) is checked as `check_model` and deserialized."""
    if isinstance(schema, str):
        check_model(data, schema, path)
        ApiClient()._ApiClient__deserialize(data, schema)  # the model's own checks: required fields, enums
    elif isinstance(schema, set):
        assert data in schema, f"{path}: {data!r} is not one of {sorted(schema)}"
    elif isinstance(schema, dict):
        assert isinstance(data, dict), f"{path}: expected an object"
        for key in schema.get("required", ()):
            assert key in data, f"{path}.{key}: required"
        for key, value in data.items():
            assert key in schema and key != "required", f"{path}.{key}: not a field of the schema"
            check_schema(value, schema[key], f"{path}.{key}")
    else:
        assert isinstance(data, schema) and not (schema is int and isinstance(data, bool)), \
            f"{path}: expected {schema.__name__}, got {data!r}"


def rendered() -> dict[str, list[dict]]:
    out = {}
    for flagfile in k8s_manifests.flagfiles():
        docs = k8s_manifests.manifests(flagfile, 2, "jpaged:latest", "jpaged-models")
        out[os.path.basename(flagfile)[:-len(".flags")]] = (flagfile, docs)
    return out


def load(name: str) -> list[dict]:
    with open(os.path.join(REPO, "configs", "k8s", name + ".yaml")) as f:
        return list(yaml.safe_load_all(f))


def pod_templates(workload: dict) -> list[dict]:
    """A Deployment's pod template, or a LeaderWorkerSet's leader and worker templates."""
    if workload["kind"] == "Deployment":
        return [workload["spec"]["template"]]
    group = workload["spec"]["leaderWorkerTemplate"]
    return [group["leaderTemplate"], group["workerTemplate"]]


def test_checked_in_manifests_are_the_generated_ones():
    generated = rendered()
    on_disk = {os.path.basename(p)[:-len(".yaml")] for p in glob.glob(os.path.join(REPO, "configs", "k8s", "*.yaml"))}
    assert on_disk == set(generated), "run python scripts/k8s_manifests.py"
    for name, (flagfile, docs) in generated.items():
        with open(os.path.join(REPO, "configs", "k8s", name + ".yaml")) as f:
            assert f.read() == k8s_manifests.render(docs, flagfile), f"{name}: run python scripts/k8s_manifests.py"
    assert generated["llama3.1-70b-v6e-16"][1][0]["kind"] == "LeaderWorkerSet"  # its slice spans hosts
    assert generated["llama3.1-70b-v6e-8"][1][0]["kind"] == "Deployment"


@pytest.mark.parametrize("name", sorted(rendered()))
def test_manifests_are_valid_kubernetes_objects(name):
    docs = load(name)
    workload, service = docs
    assert [d["kind"] for d in docs] in (["Deployment", "Service"], ["LeaderWorkerSet", "Service"])
    client = ApiClient()
    if workload["kind"] == "LeaderWorkerSet":
        assert workload["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
        check_schema(workload, LWS_SCHEMA, "LeaderWorkerSet")
    else:
        check_model(workload, "V1Deployment", "Deployment")
        client._ApiClient__deserialize(workload, "V1Deployment")  # the models' own checks: required fields, enums
        assert workload["spec"]["selector"]["matchLabels"] == workload["spec"]["template"]["metadata"]["labels"]
    check_model(service, "V1Service", "Service")
    client._ApiClient__deserialize(service, "V1Service")
    serving = pod_templates(workload)[0]  # the pods the Service sends requests to
    assert service["spec"]["selector"] == serving["metadata"]["labels"]
    assert all(t["metadata"]["labels"] != service["spec"]["selector"] for t in pod_templates(workload)[1:])
    container = serving["spec"]["containers"][0]
    assert service["spec"]["ports"][0]["targetPort"] == container["ports"][0]["name"]
    for template in pod_templates(workload):
        limits = template["spec"]["containers"][0]["resources"]["limits"]
        assert set(limits) <= {"google.com/tpu", "nvidia.com/gpu"} and len(limits) == 1


def test_a_leader_worker_set_is_one_pod_per_host_of_the_slice():
    """llama3.1-70b-v6e-16: 4 hosts of 4 chips on a v6e 4x4 slice, the mesh over all 16; the leader
    serves (HTTP probes, the coordinator port the LWS environment points at), the workers follow."""
    from jpaged.serve.multihost_replica import COORDINATOR_PORT, lws_defaults

    workload, _ = load("llama3.1-70b-v6e-16")
    group = workload["spec"]["leaderWorkerTemplate"]
    assert group["size"] == 4 and group["restartPolicy"] == "RecreateGroupOnPodRestart"
    leader, worker = (t["spec"]["containers"][0] for t in pod_templates(workload))
    flagfile_args = k8s_manifests.read_flagfile(os.path.join(REPO, "configs", "llama3.1-70b-v6e-16.flags"))
    assert "--tensor_parallel_size=16" in flagfile_args
    for template, container in zip(pod_templates(workload), (leader, worker)):
        assert template["spec"]["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": "tpu-v6e-slice",
                                                    "cloud.google.com/gke-tpu-topology": "4x4"}
        assert container["resources"]["limits"] == {"google.com/tpu": "4"}  # x 4 hosts = the 16 of the mesh
        assert "--distributed_executor=jax" in container["args"]
    assert leader["args"] == worker["args"]
    assert {"name": "coordinator", "containerPort": COORDINATOR_PORT} in leader["ports"]
    assert "readinessProbe" in leader and "readinessProbe" not in worker and "ports" not in worker
    # what --coordinator_address / --num_processes / --process_id default to in the group's third pod
    env = {"LWS_LEADER_ADDRESS": "jpaged-llama3-1-70b-v6e-16-0.jpaged-llama3-1-70b-v6e-16.default",
           "LWS_GROUP_SIZE": "4", "LWS_WORKER_INDEX": "2"}
    assert lws_defaults(env) == {"coordinator_address": f"{env['LWS_LEADER_ADDRESS']}:{COORDINATOR_PORT}",
                                 "num_processes": 4, "process_id": 2}
    assert lws_defaults({}) == {"coordinator_address": None, "num_processes": None, "process_id": None}


@pytest.mark.parametrize("name", sorted(rendered()))
def test_container_args_are_jpaged_serve_flags(name):
    from absl import flags

    from jpaged.entrypoints import serve  # defines jpaged-serve's flags

    FLAGS = flags.FLAGS
    assert FLAGS is serve.F
    flagfile_args = k8s_manifests.read_flagfile(os.path.join(REPO, "configs", name + ".flags"))
    for template in pod_templates(load(name)[0]):
        container = template["spec"]["containers"][0]
        assert container["command"] == ["jpaged-serve"]
        assert [a for a in flagfile_args if not a.startswith("--model=")] == \
            container["args"][:len(flagfile_args) - 1]
        for arg in container["args"]:
            key, sep, value = arg[2:].partition("=")
            assert arg.startswith("--") and key in FLAGS, f"{arg}: not a jpaged-serve flag"
            if sep:
                FLAGS[key].parser.parse(value)  # ValueError for a bad value
            else:
                assert FLAGS[key].boolean, f"{arg}: needs a value"


def test_the_checks_catch_bad_manifests():
    _, (deployment, _) = rendered()["llama3.1-70b-v6e-8"]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    with pytest.raises(AssertionError, match="not a field of V1Container"):
        check_model({**deployment, "spec": {**deployment["spec"], "template": {"spec": {"containers": [
            {**container, "argz": []}]}}}}, "V1Deployment", "Deployment")
    with pytest.raises(AssertionError, match="expected int"):
        check_model({**deployment, "spec": {**deployment["spec"], "replicas": "2"}}, "V1Deployment", "Deployment")
    nameless = {k: v for k, v in container.items() if k != "name"}
    with pytest.raises(ValueError, match="name"):
        ApiClient()._ApiClient__deserialize(nameless, "V1Container")
    _, (lws, _) = rendered()["llama3.1-70b-v6e-16"]
    group = lws["spec"]["leaderWorkerTemplate"]
    for bad, match in (({**lws, "spec": {**lws["spec"], "replica": 2}}, "spec.replica: not a field"),
                       ({**lws, "spec": {"replicas": 2}}, "leaderWorkerTemplate: required"),
                       ({**lws, "spec": {"leaderWorkerTemplate": {**group, "size": "4"}}}, "expected int"),
                       ({**lws, "spec": {"leaderWorkerTemplate": {**group, "restartPolicy": "Always"}}},
                        "not one of"),
                       ({**lws, "spec": {"leaderWorkerTemplate": {**group, "workerTemplate": {"spec": {
                           "containers": [{**container, "argz": []}]}}}}}, "not a field of V1Container")):
        with pytest.raises(AssertionError, match=match):
            check_schema(bad, LWS_SCHEMA, "LeaderWorkerSet")
