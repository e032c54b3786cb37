"""One engine replica's side of the gateway: its OpenAI app, called in-process, and its report.

`EngineReplicaServer` is what a Ray Serve replica (`jpaged.serve.ray`) holds; `LocalReplicaClient`
reaches one in the same process (tests, one-host use of the gateway).
"""
import asyncio
import os

from jpaged.serve.asgi_call import call_asgi


def _cached_block_hashes(engine) -> list[int]:
    """The prefix cache's keys (full blocks computed and still findable, in use or free) of an
    `LLMEngine`, or of every replica of a `DataParallelEngine`."""
    keys = []
    for replica in getattr(engine, "replicas", [engine]):
        keys.extend(replica.kv_cache.pool.cached)
    return keys


class EngineReplicaServer:
    """The server ``app_from_options(options, engine)`` builds, answering forwarded requests."""

    def __init__(self, options: dict, engine=None):
        from jpaged.entrypoints.server_app import app_from_options

        self.app = app_from_options(options, engine)
        self.engine = self.app.state.serving.engine  # the AsyncLLMEngine

    def stream(self, method: str, path: str, query: bytes, headers: list, body: bytes):
        """The app's answer as `call_asgi` parts."""
        return call_asgi(self.app, method, path, query, headers, body)

    async def report(self) -> dict:
        """Queue lengths, KV use and the prefix cache's block hashes, read on the engine thread."""
        engine = self.engine

        def read():
            metrics = engine.engine.get_metrics()
            return {"num_requests_running": metrics["num_running_requests"],
                    "num_requests_waiting": metrics["num_waiting_requests"],
                    "kv_cache_usage": metrics["kv_cache_usage"], "block_size": metrics["block_size"],
                    "block_hashes": _cached_block_hashes(engine.engine)}

        if not engine.is_running:
            raise RuntimeError("the engine is not running")
        return await asyncio.wrap_future(engine.call(read))

    def pid(self) -> int:
        return os.getpid()

    async def check_health(self) -> None:
        if not self.engine.is_running:
            raise RuntimeError("the engine loop stopped")

    def shutdown(self) -> None:
        self.engine.shutdown()


class LocalReplicaClient:
    """A `gateway.ReplicaClient` for an `EngineReplicaServer` in this process."""

    def __init__(self, name: str, server: EngineReplicaServer):
        self.name, self.server = name, server

    def stream(self, method, path, query, headers, body):
        return self.server.stream(method, path, query, headers, body)

    async def report(self) -> dict:
        return await self.server.report()
