"""Kubernetes manifests for the single-host flagfiles: N jpaged-serve replicas and their Service.

  python scripts/k8s_manifests.py                     # writes configs/k8s/<flagfile>.yaml for each
  python scripts/k8s_manifests.py --replicas 4 --image ghcr.io/me/jpaged:0.1 --out_dir /tmp/k8s

Each manifest is a Deployment of ``--replicas`` pods, one host each, and a ClusterIP Service on
port 8000. A pod runs ``jpaged-serve`` with the flagfile's flags as its arguments (its ``--model``
replaced by the checkpoint on the read-only volume ``--models_claim`` at /models) and reserves the
flagfile's accelerator: ``-v6e-N`` / ``-v5e-N`` are N TPU chips of one GKE TPU node
(``google.com/tpu``, the slice's ``gke-tpu-accelerator`` and ``gke-tpu-topology`` node labels), ``-h100``
``tensor_parallel_size`` GPUs (``nvidia.com/gpu``). ``/health`` is the startup and readiness
probe (it answers once the engine is compiled), and the API key comes from the optional Secret
``jpaged-api-key``. Flagfiles whose mesh spans hosts (``-v6e-16``) are skipped: a multi-host
replica is not served yet (docs/serving.md#past-one-host). tests/scripts/test_k8s_manifests.py re-renders
these files, checks them against the Kubernetes API's models and their args against jpaged's flags.
"""
import glob
import os
import re

from absl import app, flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
F = flags.FLAGS
flags.DEFINE_integer("replicas", 2, "Pods (engine replicas) per Deployment")
flags.DEFINE_string("image", "jpaged:latest", "Container image with jpaged installed")
flags.DEFINE_string("models_claim", "jpaged-models", "PersistentVolumeClaim holding the checkpoints")
flags.DEFINE_string("out_dir", os.path.join(REPO, "configs", "k8s"), "Where the manifests go")

PORT = 8000
TPU = {"v6e": "tpu-v6e-slice", "v5e": "tpu-v5-lite-podslice", "v5p": "tpu-v5p-slice"}  # GKE's accelerator node labels
TPU_TOPOLOGY = {1: "1x1", 4: "2x2", 8: "2x4"}  # chips of one host -> the slice's topology
GPU = {"h100": "nvidia-h100-80gb"}
CHIPS_PER_HOST = 8


def read_flagfile(path: str) -> list[str]:
    with open(path) as f:
        return [line.strip() for line in f if line.strip().startswith("--")]


def accelerator(name: str, args: list[str]) -> tuple[dict, dict] | None:
    """(resource limits, node selector) of a flagfile, by its name's suffix; None if it spans hosts."""
    m = re.search(r"-(v6e|v5e|v5p)-(\d+)$", name)
    if m:
        chips = int(m.group(2))
        if chips > CHIPS_PER_HOST:
            return None
        return ({"google.com/tpu": str(chips)},
                {"cloud.google.com/gke-tpu-accelerator": TPU[m.group(1)],
                 "cloud.google.com/gke-tpu-topology": TPU_TOPOLOGY[chips]})
    m = re.search(r"-(h100)$", name)
    if m:
        tp = next((int(a.split("=", 1)[1]) for a in args if a.startswith("--tensor_parallel_size=")), 1)
        return {"nvidia.com/gpu": str(tp)}, {"cloud.google.com/gke-accelerator": GPU[m.group(1)]}
    raise ValueError(f"{name}: no accelerator known for this flagfile's name")


def manifests(flagfile: str, replicas: int, image: str, models_claim: str) -> list[dict] | None:
    """The Deployment and Service of one flagfile (None: it spans hosts)."""
    name = os.path.basename(flagfile)[:-len(".flags")]
    flag_args = read_flagfile(flagfile)
    hardware = accelerator(name, flag_args)
    if hardware is None:
        return None
    limits, selector = hardware
    app_name = "jpaged-" + re.sub(r"[^a-z0-9-]", "-", name.lower())
    model = os.path.splitext(os.path.basename(next(a for a in flag_args if a.startswith("--model=")).split("=", 1)[1]))[0]
    args = [a for a in flag_args if not a.startswith("--model=")]
    args += [f"--model=/models/{model}", "--host=0.0.0.0", f"--port={PORT}", f"--served_model_name={model}"]
    labels = {"app.kubernetes.io/name": app_name, "app.kubernetes.io/part-of": "jpaged"}
    probe = {"httpGet": {"path": "/health", "port": PORT}, "periodSeconds": 10}
    container = {
        "name": "jpaged-serve", "image": image, "command": ["jpaged-serve"], "args": args,
        "ports": [{"name": "http", "containerPort": PORT}],
        "env": [{"name": "JPAGED_API_KEY", "valueFrom": {"secretKeyRef": {"name": "jpaged-api-key", "key": "api_key",
                                                                           "optional": True}}}],
        "resources": {"limits": limits, "requests": limits},
        "startupProbe": {**probe, "failureThreshold": 180},  # loading and compiling: up to 30 minutes
        "readinessProbe": probe,
        "livenessProbe": {**probe, "failureThreshold": 6},
        "volumeMounts": [{"name": "models", "mountPath": "/models", "readOnly": True}],
    }
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": app_name, "labels": labels},
        "spec": {"replicas": replicas, "selector": {"matchLabels": labels},
                 "template": {"metadata": {"labels": labels},
                              "spec": {"nodeSelector": selector, "terminationGracePeriodSeconds": 30,
                                       "containers": [container],
                                       "volumes": [{"name": "models", "persistentVolumeClaim": {
                                           "claimName": models_claim, "readOnly": True}}]}}},
    }
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": app_name, "labels": labels},
               "spec": {"selector": labels, "ports": [{"name": "http", "port": PORT, "targetPort": "http"}]}}
    return [deployment, service]


def render(docs: list[dict], flagfile: str) -> str:
    import yaml

    class Dumper(yaml.SafeDumper):  # every mapping written out, no &anchors / *aliases
        def ignore_aliases(self, data):
            return True

    head = (f"# Generated by scripts/k8s_manifests.py from configs/{os.path.basename(flagfile)}; "
            "do not edit (tests/scripts/test_k8s_manifests.py checks it).\n")
    return head + "---\n".join(yaml.dump(d, Dumper=Dumper, sort_keys=False) for d in docs)


def flagfiles() -> list[str]:
    return sorted(glob.glob(os.path.join(REPO, "configs", "*.flags")))


def main(argv):
    del argv
    os.makedirs(F.out_dir, exist_ok=True)
    for flagfile in flagfiles():
        docs = manifests(flagfile, F.replicas, F.image, F.models_claim)
        if docs is None:
            print(f"skipped {os.path.basename(flagfile)} (its mesh spans hosts)")
            continue
        path = os.path.join(F.out_dir, os.path.basename(flagfile)[:-len(".flags")] + ".yaml")
        with open(path, "w") as f:
            f.write(render(docs, flagfile))
        print(path)


if __name__ == "__main__":
    app.run(main)
