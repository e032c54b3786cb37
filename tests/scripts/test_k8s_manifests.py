"""configs/k8s/: the manifests `scripts/k8s_manifests.py` generates from the flagfiles are the ones
checked in, every field is one the Kubernetes API's models know (the `kubernetes` client's
``openapi_types``), with the types and required fields they give, and the server's args are valid
jpaged-serve flags."""
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


def rendered() -> dict[str, list[dict]]:
    out = {}
    for flagfile in k8s_manifests.flagfiles():
        docs = k8s_manifests.manifests(flagfile, 2, "jpaged:latest", "jpaged-models")
        if docs is not None:
            out[os.path.basename(flagfile)[:-len(".flags")]] = (flagfile, docs)
    return out


def test_checked_in_manifests_are_the_generated_ones():
    generated = rendered()
    on_disk = {os.path.basename(p)[:-len(".yaml")] for p in glob.glob(os.path.join(REPO, "configs", "k8s", "*.yaml"))}
    assert on_disk == set(generated), "run python scripts/k8s_manifests.py"
    for name, (flagfile, docs) in generated.items():
        with open(os.path.join(REPO, "configs", "k8s", name + ".yaml")) as f:
            assert f.read() == k8s_manifests.render(docs, flagfile), f"{name}: run python scripts/k8s_manifests.py"
    assert "llama3.1-70b-v6e-16" not in generated  # spans hosts: not a single-host replica


@pytest.mark.parametrize("name", sorted(rendered()))
def test_manifests_are_valid_kubernetes_objects(name):
    with open(os.path.join(REPO, "configs", "k8s", name + ".yaml")) as f:
        docs = list(yaml.safe_load_all(f))
    assert [d["kind"] for d in docs] == ["Deployment", "Service"]
    client = ApiClient()
    for doc in docs:
        type_name = "V1" + doc["kind"]
        check_model(doc, type_name, doc["kind"])
        client._ApiClient__deserialize(doc, type_name)  # the models' own checks: required fields, enums
    deployment, service = docs
    pod = deployment["spec"]["template"]
    assert deployment["spec"]["selector"]["matchLabels"] == pod["metadata"]["labels"] == service["spec"]["selector"]
    container = pod["spec"]["containers"][0]
    assert service["spec"]["ports"][0]["targetPort"] == container["ports"][0]["name"]
    limits = container["resources"]["limits"]
    assert set(limits) <= {"google.com/tpu", "nvidia.com/gpu"} and len(limits) == 1


@pytest.mark.parametrize("name", sorted(rendered()))
def test_container_args_are_jpaged_serve_flags(name):
    from absl import flags

    from jpaged.entrypoints import serve  # defines jpaged-serve's flags

    FLAGS = flags.FLAGS
    assert FLAGS is serve.F
    with open(os.path.join(REPO, "configs", "k8s", name + ".yaml")) as f:
        container = next(yaml.safe_load_all(f))["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["jpaged-serve"]
    flagfile_args = k8s_manifests.read_flagfile(os.path.join(REPO, "configs", name + ".flags"))
    assert [a for a in flagfile_args if not a.startswith("--model=")] == container["args"][:len(flagfile_args) - 1]
    for arg in container["args"]:
        key, _, value = arg[2:].partition("=")
        assert arg.startswith("--") and key in FLAGS, f"{arg}: not a jpaged-serve flag"
        FLAGS[key].parser.parse(value)  # ValueError for a bad value


def test_the_checks_catch_bad_manifests():
    name = sorted(rendered())[0]
    _, (deployment, _) = rendered()[name]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    with pytest.raises(AssertionError, match="not a field of V1Container"):
        check_model({**deployment, "spec": {**deployment["spec"], "template": {"spec": {"containers": [
            {**container, "argz": []}]}}}}, "V1Deployment", "Deployment")
    with pytest.raises(AssertionError, match="expected int"):
        check_model({**deployment, "spec": {**deployment["spec"], "replicas": "2"}}, "V1Deployment", "Deployment")
    nameless = {k: v for k, v in container.items() if k != "name"}
    with pytest.raises(ValueError, match="name"):
        ApiClient()._ApiClient__deserialize(nameless, "V1Container")
