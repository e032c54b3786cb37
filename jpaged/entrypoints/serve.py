"""The OpenAI-compatible server: ``jpaged-serve`` or ``python scripts/serve.py``.

  jpaged-serve                                             # embedded SmolLM2-135M-Instruct on :8000
  jpaged-serve --model path/to/hf_dir --host 0.0.0.0 --port 8000 --api_key sk-local
  jpaged-serve --config smollm2-135m-instruct --max_num_seqs 64 --max_queued_requests 256

The engine loads and compiles its first step before the port opens, so ``GET /health`` answers 200
as soon as it answers at all. SIGTERM (or Ctrl-C) drains: new requests get a 503, requests in
flight finish for up to ``--shutdown_timeout`` seconds, the rest end with ``finish_reason="abort"``
(streams with their last chunk and ``data: [DONE]``), then the process exits 0.
"""
import logging
import os
import signal
import sys

from absl import app, flags

from jpaged.entrypoints import engine_flags
from jpaged.entrypoints.engine_flags import define_engine_flags, llm_args
from jpaged.logger import configure_logging, logger

F = flags.FLAGS
define_engine_flags()
flags.adopt_module_key_flags(engine_flags)  # so that --help lists them
flags.DEFINE_string("host", "127.0.0.1", "Address to listen on")
flags.DEFINE_integer("port", 8000, "Port to listen on")
flags.DEFINE_string("api_key", os.environ.get("JPAGED_API_KEY"),
                    "If set, every /v1 call needs `Authorization: Bearer <key>` (default: $JPAGED_API_KEY)")
flags.DEFINE_string("served_model_name", None, "Model name in the API (default: --model or --config)")
flags.DEFINE_integer("max_queued_requests", None,
                     "Waiting requests beyond which new ones get a 503 (default: no limit)")
flags.DEFINE_string("chat_template", None, "Jinja chat template (a file or the template itself); "
                    "default: the tokenizer's")
flags.DEFINE_float("shutdown_timeout", 10.0, "Seconds in-flight requests get to finish after SIGTERM; "
                   "then they end with finish_reason=abort")
flags.DEFINE_integer("max_request_body_bytes", 8 * 2**20, "Request bodies larger than this get a 413")
flags.DEFINE_multi_string("lora_modules", [], "LoRA adapters served under their own model names, each "
                          "name=path (a PEFT directory); needs --enable_lora")
flags.DEFINE_enum("log_level", "info", ["critical", "error", "warning", "info", "debug"], "uvicorn log level")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def build_app():
    """Loads the engine (warm-up included) and returns the FastAPI app."""
    from jpaged.engine.async_engine import AsyncLLMEngine
    from jpaged.entrypoints.lora_adapters import parse_lora_modules
    from jpaged.entrypoints.openai_server import create_app

    model, kwargs = llm_args()
    kwargs.setdefault("precompile", True)  # no compilation inside a request's latency
    async_engine = AsyncLLMEngine.from_args(model, max_queued_requests=F.max_queued_requests, **kwargs)
    chat_template = F.chat_template
    if chat_template and os.path.isfile(chat_template):
        with open(chat_template) as f:
            chat_template = f.read()
    name = F.served_model_name or (model.rstrip("/") if model else DEFAULT_MODEL_NAME)
    return create_app(async_engine, served_model_name=name, api_key=F.api_key or None, chat_template=chat_template,
                      max_body_bytes=F.max_request_body_bytes, lora_modules=parse_lora_modules(F.lora_modules))


FLUSH_SECONDS = 5.0  # after a drain, what the connections get to send their last chunks


def draining_server(app, **config):
    """A uvicorn server whose shutdown first drains the app (`openai_server.drain`), and that exits
    normally on SIGTERM (uvicorn re-raises the signal it caught, which ends the process with it)."""
    import uvicorn

    from jpaged.entrypoints.openai_server import drain

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig, frame):
            if sig == signal.SIGTERM and not self.should_exit:
                self.should_exit = True  # handled in full: not raised again on the way out
            else:
                super().handle_exit(sig, frame)

        async def shutdown(self, sockets=None):
            if not self.force_exit:
                aborted = await drain(app, F.shutdown_timeout)
                if aborted:
                    logger.warning("drain: %d request(s) still running after %g s were "
                                                        "aborted", aborted, F.shutdown_timeout)
            await super().shutdown(sockets)

    return DrainingServer(uvicorn.Config(app, timeout_graceful_shutdown=FLUSH_SECONDS, **config))


def main(argv):
    del argv
    logging.basicConfig(level=logging.INFO)
    configure_logging()
    draining_server(build_app(), host=F.host, port=F.port, log_level=F.log_level).run()


def run():
    """Entry point of ``jpaged-serve`` and ``scripts/serve.py``."""
    for flag in F.get_key_flags_for_module(sys.modules[__name__]):  # --help lists the flags of the
        F.register_key_flag_for_module(sys.argv[0], flag)             # program's main module
    app.run(main)


if __name__ == "__main__":
    run()
