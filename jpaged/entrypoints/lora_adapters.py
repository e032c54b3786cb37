"""The server's LoRA adapters: served under their own model names beside the base model.

``--lora_modules name=path ...`` registers adapters at start; ``POST /v1/load_lora_adapter``
(``{"lora_name", "lora_path"}``) and ``POST /v1/unload_lora_adapter`` (``{"lora_name"}``) change
the set while serving (behind ``--api_key`` like every ``/v1`` route). A request's ``model`` picks
the base model or an adapter; ``GET /v1/models`` lists both.
"""
import asyncio
import threading
import time

from fastapi import Request
from pydantic import BaseModel, ConfigDict

from jpaged.lora.request import LoRARequest


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    lora_name: str
    lora_int_id: int | None = None


def parse_lora_modules(specs) -> list[tuple[str, str]]:
    """(name, path) of each ``name=path`` of ``--lora_modules``; ValueError naming a bad one."""
    out = []
    for spec in specs or []:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora_modules: {spec!r} is not name=path")
        out.append((name, path))
    return out


class ServedAdapters:
    """Adapters by API model name, each a `LoRARequest` with its own id; checked (read from disk)
    by the engine's `LoRAManager` before it is listed."""

    def __init__(self, lora_manager, base_model_name: str):
        self.manager, self.base_model_name = lora_manager, base_model_name
        self.by_name: dict[str, LoRARequest] = {}
        self.created: dict[str, int] = {}
        self._next_id = 1
        self._lock = threading.Lock()

    def load(self, name: str, path: str) -> LoRARequest:
        """Registers an adapter (ValueError: no LoRA, a taken name, a bad adapter)."""
        if self.manager is None:
            raise ValueError("lora_name: this server serves no adapters (start it with --enable_lora)")
        if name == self.base_model_name:
            raise ValueError(f"lora_name={name!r}: the base model's name")
        with self._lock:
            if name in self.by_name:
                raise ValueError(f"lora_name={name!r}: already loaded (unload it first)")
            request = LoRARequest(name, self._next_id, path)
            self._next_id += 1
        self.manager.check(request)
        with self._lock:
            self.by_name[name] = request
            self.created[name] = int(time.time())
        return request

    def unload(self, name: str) -> bool:
        """Forgets an adapter; False while running requests use it. KeyError when unknown."""
        request = self.by_name[name]
        if not self.manager.remove(request.lora_name):
            return False
        with self._lock:
            self.by_name.pop(name, None)
            self.created.pop(name, None)
        return True

    def cards(self) -> list[dict]:
        return [{"id": name, "object": "model", "created": self.created[name], "owned_by": "jpaged",
                 "root": request.lora_path, "parent": self.base_model_name}
                for name, request in sorted(self.by_name.items())]


def add_lora_routes(app, serving, api_error) -> None:
    """``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` on ``app``; ``api_error(status,
    message, param)`` makes the OpenAI-shaped error raised."""
    adapters: ServedAdapters = serving.adapters

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(raw: Request):
        body = await serving.parse(raw, LoadLoRAAdapterRequest)
        try:
            await asyncio.to_thread(adapters.load, body.lora_name, body.lora_path)
        except ValueError as e:
            raise api_error(400, str(e), "lora_path" if "lora_path" in str(e) or "adapter" in str(e) else "lora_name")
        return {"object": "lora_adapter", "lora_name": body.lora_name, "status": "loaded"}

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(raw: Request):
        body = await serving.parse(raw, UnloadLoRAAdapterRequest)
        try:
            unloaded = adapters.unload(body.lora_name)
        except KeyError:
            raise api_error(404, f"lora_name={body.lora_name!r}: no such adapter", "lora_name") from None
        if not unloaded:
            raise api_error(400, f"lora_name={body.lora_name!r}: in use by running requests; retry when they end",
                            "lora_name")
        return {"object": "lora_adapter", "lora_name": body.lora_name, "status": "unloaded"}
