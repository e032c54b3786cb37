"""The server app of ``jpaged-serve`` built from plain settings (`jpaged.entrypoints.serve.server_options`):
the engine, the FastAPI app over it, and a uvicorn server that drains on SIGTERM. The command line
(`jpaged.entrypoints.serve`) and the processes past one host (`jpaged.serve`: Ray Serve replicas,
a multi-host engine's leader) build their servers here.
"""
import os
import signal

from jpaged.logger import logger

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def served_name(options: dict) -> str:
    model = options["model"]
    return options.get("served_model_name") or (model.rstrip("/") if model else DEFAULT_MODEL_NAME)


def resolve_chat_template(chat_template: str | None) -> str | None:
    """``chatml_tools``, a file holding a template, or the template itself."""
    if chat_template == "chatml_tools":
        from jpaged.agents.templates import CHATML_TOOLS_TEMPLATE

        return CHATML_TOOLS_TEMPLATE
    if chat_template and os.path.isfile(chat_template):
        with open(chat_template) as f:
            return f.read()
    return chat_template


def engine_from_options(options: dict):
    """The engine (`create_engine`: warm-up included) of `server_options`' settings."""
    from jpaged.config_resolution import engine_config
    from jpaged.engine import create_engine

    kwargs = dict(options["engine_kwargs"])
    kwargs.setdefault("precompile", True)  # no compilation inside a request's latency
    return create_engine(engine_config(options["model"], **kwargs))


def app_from_options(options: dict, engine=None):
    """The FastAPI app for `server_options`' settings, over ``engine`` (default: `engine_from_options`,
    loaded here; a multi-host leader passes its `jpaged.serve.mirrored_engine.LeaderEngine`)."""
    from jpaged.entrypoints.async_engine import AsyncLLMEngine
    from jpaged.entrypoints.lora_adapters import parse_lora_modules
    from jpaged.entrypoints.openai_server import check_allowed_origins, create_app

    allowed_origins = check_allowed_origins(options["allowed_origins"])  # a bad one fails before the model loads
    engine = engine_from_options(options) if engine is None else engine
    async_engine = AsyncLLMEngine(engine, max_queued_requests=options["max_queued_requests"])
    return create_app(async_engine, served_model_name=served_name(options), api_key=options["api_key"],
                      chat_template=resolve_chat_template(options["chat_template"]),
                      max_body_bytes=options["max_request_body_bytes"], allowed_origins=allowed_origins,
                      enable_weight_updates=options["enable_weight_updates"],
                      tool_call_parser=options["tool_call_parser"], reasoning_parser=options["reasoning_parser"],
                      enable_auto_tool_choice=options["enable_auto_tool_choice"],
                      lora_modules=parse_lora_modules(options["lora_modules"]))


def ready_line(app, url: str) -> str:
    """The one line that says the server is up: where, what, and the KV pool it serves from."""
    serving = app.state.serving
    engine = serving.engine.engine
    replica = getattr(engine, "replicas", [engine])[0]  # a data-parallel engine: each replica's pool
    return (f"ready on {url} ({serving.model_name}, {replica.num_blocks} blocks of {replica.config.cache.block_size} "
            f"tokens, max_model_len {engine.max_model_len})")


FLUSH_SECONDS = 5.0  # after a drain, what the connections get to send their last chunks


def draining_server(app, *, shutdown_timeout: float = 10.0, **config):
    """A uvicorn server whose shutdown first drains the app (`openai_server.drain`: requests in flight
    get up to ``shutdown_timeout`` seconds, then end aborted), and that exits normally on SIGTERM (uvicorn re-raises the signal it caught, which ends the process with it)."""
    import uvicorn

    from jpaged.entrypoints.openai_server import drain

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig, frame):
            if sig == signal.SIGTERM and not self.should_exit:
                self.should_exit = True  # handled in full: not raised again on the way out
            else:
                super().handle_exit(sig, frame)

        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started:  # listening, the engine warm: /health answers 200 from now on
                address = self.servers[0].sockets[0].getsockname()
                if isinstance(address, tuple):  # (host, port[, flow, scope]); a Unix socket's is its path
                    host, port = address[:2]
                    address = f"http://{f'[{host}]' if ':' in host else host}:{port}"
                logger.info("%s", ready_line(app, address))

        async def shutdown(self, sockets=None):
            if not self.force_exit:
                aborted = await drain(app, shutdown_timeout)
                if aborted:
                    logger.warning("drain: %d request(s) still running after %g s were "
                                                        "aborted", aborted, shutdown_timeout)
            await super().shutdown(sockets)

    return DrainingServer(uvicorn.Config(app, timeout_graceful_shutdown=FLUSH_SECONDS, **config))
