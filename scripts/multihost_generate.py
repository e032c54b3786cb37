"""Serve one batch with a mesh spanning several processes (multi-host), here on one machine.

  python scripts/multihost_generate.py --model DIR --num_processes 2 --local_devices 2

Without --process_id it is the launcher: it starts ``num_processes`` copies of itself on loopback
(127.0.0.1), each with ``local_devices`` CPU devices, and waits. Each copy calls
`jax.distributed.initialize`, builds `LLM(..., tensor_parallel_size=<all devices of all
processes>)` over the global mesh and runs the same batch: the scheduler and block tables run in
every process identically (JAX's multi-controller model), and the weights and KV pool are sharded
across the processes' devices. Process 0 prints the outputs (and writes --output_json).

On real multi-host TPU/GPU, start one process per host with the same flags plus --process_id,
--coordinator (host:port of process 0) and without --local_devices.
"""
import json
import os
import subprocess
import sys

from absl import app, flags

F = flags.FLAGS
flags.DEFINE_string("model", None, "HF directory / .gguf / preset (default: embedded SmolLM2)")
flags.DEFINE_integer("num_processes", 2, "Processes in the job")
flags.DEFINE_integer("process_id", None, "This process's id; unset = launch all processes locally")
flags.DEFINE_string("coordinator", "127.0.0.1:12356", "host:port of process 0")
flags.DEFINE_integer("local_devices", 2, "CPU devices per process (local launch only)")
flags.DEFINE_multi_string("prompt", [], "Prompt (repeatable); default: a few token-id prompts")
flags.DEFINE_integer("max_tokens", 16, "New tokens per prompt (greedy)")
flags.DEFINE_string("output_json", None, "Where process 0 writes the generated token ids")


def launch() -> int:
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={F.local_devices}",
               JAX_PLATFORMS="cpu")
    args = [a for a in sys.argv[1:] if not a.startswith("--process_id")]
    procs = [subprocess.Popen([sys.executable, __file__, *args, f"--process_id={i}"], env=env)
             for i in range(F.num_processes)]
    return max(p.wait() for p in procs)


def serve() -> None:
    import jax

    from jpaged.serve.multihost_replica import join

    join(F.coordinator, F.num_processes, F.process_id)  # CPU devices talk across processes through gloo
    from jpaged import LLM, SamplingParams

    llm = LLM(F.model, tensor_parallel_size=jax.device_count(), num_kv_blocks=256, max_model_len=512)
    prompts = F.prompt or [[5, 17, 42, 99, 7], [3] * 20, list(range(10, 50))]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=F.max_tokens, ignore_eos=True),
                        use_tqdm=False)
    if jax.process_index() == 0:
        tokens = [o.outputs[0].token_ids for o in outs]
        print(f"{jax.process_count()} processes, {jax.device_count()} devices, mesh "
              f"{dict(llm.llm_engine.mesh.shape)}")
        for o in outs:
            print(o.outputs[0].token_ids, repr(o.outputs[0].text))
        if F.output_json:
            with open(F.output_json, "w") as f:
                json.dump(tokens, f)
    jax.distributed.shutdown()


def main(argv):
    del argv
    if F.process_id is None:
        sys.exit(launch())
    serve()


if __name__ == "__main__":
    app.run(main)
