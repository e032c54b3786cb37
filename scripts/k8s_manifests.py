"""Kubernetes manifests for the flagfiles: jpaged-serve replicas and their Service.

  python scripts/k8s_manifests.py                     # writes configs/k8s/<flagfile>.yaml for each
  python scripts/k8s_manifests.py --replicas 4 --image ghcr.io/me/jpaged:0.1 --out_dir /tmp/k8s

A pod runs ``jpaged-serve`` with the flagfile's flags as its arguments (its ``--model`` replaced by
the checkpoint on the read-only volume ``--models_claim`` at /models) and reserves the flagfile's
accelerator: ``-v6e-N`` / ``-v5e-N`` are N TPU chips (``-v5p-N``: N TensorCores, N/2 chips) with
GKE's ``gke-tpu-accelerator`` and ``gke-tpu-topology`` node labels for the slice, ``-h100``
``tensor_parallel_size`` GPUs (``nvidia.com/gpu``). ``/health`` is the startup and readiness
probe (it answers once the engine is compiled), and the API key comes from the optional Secret
``jpaged-api-key``. A ClusterIP Service on port 8000 fronts the serving pods.

- One-host slices (at most 8 chips): a Deployment of ``--replicas`` pods, each a whole engine.
- Slices spanning hosts (``-v6e-16``: 4 hosts of 4 chips, ``-v5p-64``: 8 hosts of 4 chips): a
  LeaderWorkerSet (the ``leaderworkerset.x-k8s.io`` CRD) of ``--replicas`` groups, one pod per host
  of the slice. Every pod runs ``jpaged-serve --distributed_executor=jax``, which joins the group's
  processes with ``jax.distributed`` from the LWS environment (``LWS_LEADER_ADDRESS`` on port 8476,
  ``LWS_GROUP_SIZE``, ``LWS_WORKER_INDEX``; LWS also gives each pod its ``TPU_WORKER_ID``, the same
  index): the leader (worker 0) serves HTTP, the workers follow its engine calls and serve
  nothing (docs/serving.md#past-one-host). A pod that fails restarts its whole group. The
  Service selects the leaders.

tests/scripts/test_k8s_manifests.py re-renders these files, checks them against the Kubernetes API's
models (the LeaderWorkerSet's own fields against the CRD's schema) and their args against jpaged's flags.
"""
import glob
import os
import re

from absl import app, flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
F = flags.FLAGS
flags.DEFINE_integer("replicas", 2, "Engine replicas per manifest (Deployment pods, or LeaderWorkerSet groups)")
flags.DEFINE_string("image", "jpaged:latest", "Container image with jpaged installed")
flags.DEFINE_string("models_claim", "jpaged-models", "PersistentVolumeClaim holding the checkpoints")
flags.DEFINE_string("out_dir", os.path.join(REPO, "configs", "k8s"), "Where the manifests go")

PORT = 8000
COORDINATOR_PORT = 8476  # jpaged.serve.multihost_replica.COORDINATOR_PORT: the leader's jax.distributed coordinator
TPU = {"v6e": "tpu-v6e-slice", "v5e": "tpu-v5-lite-podslice", "v5p": "tpu-v5p-slice"}  # GKE's accelerator node labels
TPU_TOPOLOGY = {("v6e", 1): "1x1", ("v6e", 4): "2x2", ("v6e", 8): "2x4", ("v6e", 16): "4x4",
                ("v5e", 1): "1x1", ("v5e", 4): "2x2", ("v5e", 8): "2x4", ("v5e", 16): "4x4",
                ("v5p", 4): "2x2x1", ("v5p", 32): "2x4x4"}  # (version, chips) -> the slice's topology
GPU = {"h100": "nvidia-h100-80gb"}
CHIPS_PER_HOST = 8             # the most chips of a one-host slice
CHIPS_PER_HOST_MULTIHOST = 4   # each host's chips in a slice spanning hosts
LEADER, WORKER = "leader", "worker"  # app.kubernetes.io/component of a LeaderWorkerSet's pods


def read_flagfile(path: str) -> list[str]:
    with open(path) as f:
        return [line.strip() for line in f if line.strip().startswith("--")]


def accelerator(name: str, args: list[str]) -> tuple[dict, dict, int]:
    """(each pod's resource limits, its node selector, the hosts of one replica) of a flagfile, by
    its name's suffix."""
    m = re.search(r"-(v6e|v5e|v5p)-(\d+)$", name)
    if m:
        version, n = m.group(1), int(m.group(2))
        chips = n // 2 if version == "v5p" else n  # v5p slices are named by TensorCores, two per chip
        hosts = 1 if chips <= CHIPS_PER_HOST else chips // CHIPS_PER_HOST_MULTIHOST
        return ({"google.com/tpu": str(chips // hosts)},
                {"cloud.google.com/gke-tpu-accelerator": TPU[version],
                 "cloud.google.com/gke-tpu-topology": TPU_TOPOLOGY[version, chips]}, hosts)
    m = re.search(r"-(h100)(?:x\d+)?$", name)  # "-h100" or "-h100x4": the GPUs are the tensor parallel size
    if m:
        tp = next((int(a.split("=", 1)[1]) for a in args if a.startswith("--tensor_parallel_size=")), 1)
        return {"nvidia.com/gpu": str(tp)}, {"cloud.google.com/gke-accelerator": GPU[m.group(1)]}, 1
    raise ValueError(f"{name}: no accelerator known for this flagfile's name")


def manifests(flagfile: str, replicas: int, image: str, models_claim: str) -> list[dict]:
    """A flagfile's workload (a Deployment, or a LeaderWorkerSet when its slice spans hosts) and Service."""
    name = os.path.basename(flagfile)[:-len(".flags")]
    flag_args = read_flagfile(flagfile)
    limits, selector, hosts = accelerator(name, flag_args)
    app_name = "jpaged-" + re.sub(r"[^a-z0-9-]", "-", name.lower())
    model = os.path.splitext(os.path.basename(next(a for a in flag_args if a.startswith("--model=")).split("=", 1)[1]))[0]
    args = [a for a in flag_args if not a.startswith("--model=")]
    args += [f"--model=/models/{model}", "--host=0.0.0.0", f"--port={PORT}", f"--served_model_name={model}"]
    if hosts > 1:
        args.append("--distributed_executor=jax")
    labels = {"app.kubernetes.io/name": app_name, "app.kubernetes.io/part-of": "jpaged"}
    probe = {"httpGet": {"path": "/health", "port": PORT}, "periodSeconds": 10}
    server = {  # the container that serves HTTP
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

    def pod_template(pod_labels: dict, container: dict) -> dict:
        return {"metadata": {"labels": pod_labels},
                "spec": {"nodeSelector": selector, "terminationGracePeriodSeconds": 30, "containers": [container],
                         "volumes": [{"name": "models", "persistentVolumeClaim": {"claimName": models_claim,
                                                                                   "readOnly": True}}]}}

    if hosts == 1:
        workload = {
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": app_name, "labels": labels},
            "spec": {"replicas": replicas, "selector": {"matchLabels": labels},
                     "template": pod_template(labels, server)},
        }
        serving = labels
    else:
        leader = {**server, "ports": server["ports"] + [{"name": "coordinator", "containerPort": COORDINATOR_PORT}]}
        worker = {k: v for k, v in server.items()  # follows the leader: no HTTP, no API key
                  if k not in ("ports", "env", "startupProbe", "readinessProbe", "livenessProbe")}
        serving = {**labels, "app.kubernetes.io/component": LEADER}
        workload = {
            "apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet",
            "metadata": {"name": app_name, "labels": labels},
            "spec": {"replicas": replicas, "leaderWorkerTemplate": {
                "size": hosts, "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": pod_template(serving, leader),
                "workerTemplate": pod_template({**labels, "app.kubernetes.io/component": WORKER}, worker)}},
        }
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": app_name, "labels": labels},
               "spec": {"selector": serving, "ports": [{"name": "http", "port": PORT, "targetPort": "http"}]}}
    return [workload, service]


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
        path = os.path.join(F.out_dir, os.path.basename(flagfile)[:-len(".flags")] + ".yaml")
        with open(path, "w") as f:
            f.write(render(docs, flagfile))
        print(path)


if __name__ == "__main__":
    app.run(main)
