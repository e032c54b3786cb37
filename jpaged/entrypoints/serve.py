"""The OpenAI-compatible server: ``jpaged-serve`` or ``python scripts/serve.py``.

  jpaged-serve                                             # embedded SmolLM2-135M-Instruct on :8000
  jpaged-serve --model path/to/hf_dir --host 0.0.0.0 --port 8000 --api_key sk-local
  jpaged-serve --config smollm2-135m-instruct --max_num_seqs 64 --max_queued_requests 256
  jpaged-serve --model Qwen/Qwen3-0.6B --enable_auto_tool_choice --tool_call_parser hermes --reasoning_parser qwen3
  jpaged-serve --distributed_executor ray --num_replicas 2 --model DIR          # Ray Serve replicas, one gateway
  jpaged-serve --distributed_executor ray --tpu_topology v6e:4x4 --model DIR    # each replica a 4-host TPU slice
  jpaged-serve --distributed_executor jax --model DIR   # on every host of one engine (a LeaderWorkerSet's pods)

The engine loads and compiles its first step before the port opens, so ``GET /health`` answers 200
as soon as it answers at all; then one line on stderr says so: ``jpaged: ready on
http://HOST:PORT (MODEL, N blocks of B tokens, max_model_len L)``. SIGTERM (or Ctrl-C) drains: new
requests get a 503, requests in flight finish for up to ``--shutdown_timeout`` seconds, the rest end
with ``finish_reason="abort"`` (streams with their last chunk and ``data: [DONE]``), then the
process exits 0.
"""
import logging
import os
import sys

from absl import app, flags

from jpaged.entrypoints import flag_help
from jpaged.entrypoints.engine_flags import define_engine_flags, llm_args
from jpaged.entrypoints.server_app import app_from_options, draining_server, resolve_chat_template
from jpaged.logger import configure_logging
from jpaged.serve.multihost_replica import COORDINATOR_PORT, lws_defaults

F = flags.FLAGS
define_engine_flags()  # --model, --config and every engine setting (--help lists them, grouped)
flags.DEFINE_string("host", "127.0.0.1", "Address to listen on")
flags.DEFINE_integer("port", 8000, "Port to listen on")
flags.DEFINE_string("api_key", os.environ.get("JPAGED_API_KEY"),
                    "If set, every /v1 call needs `Authorization: Bearer <key>` (default: $JPAGED_API_KEY)")
flags.DEFINE_string("served_model_name", None, "Model name in the API (default: --model or --config)")
flags.DEFINE_integer("max_queued_requests", None,
                     "Waiting requests beyond which new ones get a 503 (default: no limit)")
flags.DEFINE_string("chat_template", None, "Jinja chat template (a file, the template itself, or "
                    "`chatml_tools`: ChatML with hermes tool calls, for ChatML models without tool support); "
                    "default: the tokenizer's")
flags.DEFINE_bool("enable_auto_tool_choice", False, 'Allow tool_choice="auto" (the OpenAI default with tools): '
                  "the model's own tool-call format is parsed with --tool_call_parser")
flags.DEFINE_enum("tool_call_parser", None, ["hermes", "llama3_json", "mistral", "pythonic"],
                  "How the model writes tool calls: hermes (Qwen2.5/Qwen3, SmolLM3, Hermes), llama3_json "
                  "(Llama 3.1/3.2), mistral ([TOOL_CALLS]), pythonic (Llama 3.2/4 pythonic, ToolACE)")
flags.DEFINE_enum("reasoning_parser", None, ["deepseek_r1", "qwen3"],
                  "Split the <think>...</think> part off as reasoning_content: deepseek_r1 (the template "
                  "opens <think>), qwen3 (the output opens it)")
flags.DEFINE_float("shutdown_timeout", 10.0, "Seconds in-flight requests get to finish after SIGTERM; "
                   "then they end with finish_reason=abort")
flags.DEFINE_integer("max_request_body_bytes", 8 * 2**20, "Request bodies larger than this get a 413")
flags.DEFINE_list("allowed_origins", None, "Web origins whose pages may call the API from a browser "
                  "(comma-separated, e.g. https://app.example,http://localhost:3000, or *): their CORS preflights "
                  "are answered; default: none")
flags.DEFINE_bool("enable_weight_updates", False, "Serve POST /update_weights (new weights from a path on "
                  "this machine's disk; behind --api_key); off: 403")
flags.DEFINE_multi_string("lora_modules", [], "LoRA adapters served under their own model names, each "
                          "name=path (a PEFT directory); needs --enable_lora")
flags.DEFINE_enum("distributed_executor", None, ["ray", "jax"], "ray: run the engine replicas as Ray Serve replicas "
                  "behind a KV-cache-aware gateway (needs `pip install jpaged[ray]`); jax: this process is one host of "
                  "an engine spanning hosts, started with the others by something else (a Kubernetes LeaderWorkerSet): "
                  "process 0 serves, the others follow its engine calls (--coordinator_address, --num_processes, "
                  "--process_id); default: one engine in this process")
flags.DEFINE_integer("num_replicas", 1, "Engine replicas (with --distributed_executor ray), each on its own devices")
flags.DEFINE_integer("num_hosts_per_replica", None, "Hosts of each replica's engine (with --distributed_executor ray): "
                     "one Ray actor per host in a placement group, jax.distributed across them, the first serves; "
                     "default: 1, or --tpu_topology's hosts")
flags.DEFINE_string("tpu_topology", None, "With --distributed_executor ray: each replica reserves a whole TPU slice of "
                    "this version and topology, e.g. v6e:4x4 (ray.util.tpu's slice placement group, one host per "
                    "bundle)")
flags.DEFINE_enum("routing", "prefix", ["prefix", "least_loaded", "round_robin"], "How the gateway picks a replica "
                  "(with --distributed_executor ray): the longest cached prefix (then the least loaded), the least "
                  "loaded (queue, then KV use), or in turn")
flags.DEFINE_string("ray_address", None, "The Ray cluster to join (default: RAY_ADDRESS, else a local one)")
flags.DEFINE_float("num_cpus_per_replica", 1.0, "CPUs Ray reserves for each replica")
flags.DEFINE_float("num_gpus_per_replica", 0.0, "GPUs Ray gives each replica (its devices)")
flags.DEFINE_float("num_tpus_per_replica", 0.0, "TPU chips Ray gives each replica (its devices)")
_LWS = lws_defaults()
flags.DEFINE_string("coordinator_address", _LWS["coordinator_address"], "With --distributed_executor jax: host:port "
                    "of process 0's jax.distributed coordinator (default: $LWS_LEADER_ADDRESS:"
                    f"{COORDINATOR_PORT})")
flags.DEFINE_integer("num_processes", _LWS["num_processes"], "With --distributed_executor jax: the engine's processes, "
                     "one per host (default: $LWS_GROUP_SIZE)")
flags.DEFINE_integer("process_id", _LWS["process_id"], "With --distributed_executor jax: this process's index, 0 "
                     "serves (default: $LWS_WORKER_INDEX)")
flags.DEFINE_enum("log_level", "info", ["critical", "error", "warning", "info", "debug"], "uvicorn log level")

def server_options() -> dict:
    """The server's settings from the flags, as plain values: what `app_from_options` (here, or in
    a Ray Serve replica, `jpaged.serve.ray`) builds the app from."""
    model, engine_kwargs = llm_args()
    return {"model": model, "engine_kwargs": engine_kwargs, "max_queued_requests": F.max_queued_requests,
            "served_model_name": F.served_model_name, "api_key": F.api_key or None,
            "chat_template": resolve_chat_template(F.chat_template),  # a file's text: replicas may run elsewhere
            "max_request_body_bytes": F.max_request_body_bytes,
            "allowed_origins": list(F.allowed_origins or ()), "enable_weight_updates": F.enable_weight_updates,
            "tool_call_parser": F.tool_call_parser, "reasoning_parser": F.reasoning_parser,
            "enable_auto_tool_choice": F.enable_auto_tool_choice, "lora_modules": list(F.lora_modules),
            "shutdown_timeout": F.shutdown_timeout}


def build_app():
    """Loads the engine (warm-up included) and returns the FastAPI app."""
    return app_from_options(server_options())


def main(argv):
    del argv
    logging.basicConfig(level=logging.INFO)
    configure_logging()
    if F.distributed_executor == "ray":
        from jpaged.serve.ray import run

        run(server_options(), host=F.host, port=F.port, address=F.ray_address, num_replicas=F.num_replicas,
            routing=F.routing, num_cpus=F.num_cpus_per_replica, num_gpus=F.num_gpus_per_replica,
            num_tpus=F.num_tpus_per_replica, num_hosts_per_replica=F.num_hosts_per_replica,
            tpu_topology=F.tpu_topology)
        return
    if F.distributed_executor == "jax":
        from jpaged.serve.multihost_replica import run_process

        run_process(server_options(), coordinator=F.coordinator_address, num_processes=F.num_processes,
                    process_id=F.process_id, host=F.host, port=F.port, log_level=F.log_level)
        return
    draining_server(build_app(), shutdown_timeout=F.shutdown_timeout, host=F.host, port=F.port,
                    log_level=F.log_level).run()


def run():
    """Entry point of ``jpaged-serve`` and ``scripts/serve.py``."""
    prog = os.path.basename(sys.argv[0]) or "jpaged-serve"
    app.run(main, flags_parser=lambda argv: flag_help.parse_flags(argv, prog, __doc__))


if __name__ == "__main__":
    run()
