"""The server's training-loop routes (vLLM's RL API): pause, resume, sleep, wake up, new weights.

``POST /pause`` (``?abort=true``: requests in flight end now with ``finish_reason="abort"``;
otherwise they wait), ``POST /resume``, ``POST /sleep`` (``?level=1|2``), ``POST /wake_up``,
``POST /update_weights`` (body ``{"path": ...}``: a Hugging Face directory, safetensors file or
orbax checkpoint on the server's disk; 403 unless the server runs with ``--enable_weight_updates``),
``GET /is_paused``, ``GET /is_sleeping``. Behind ``--api_key`` like ``/v1``. An engine that refuses
(requests in flight, asleep, a weight mismatch) answers 400 (mismatch) or 409 (state), with the
OpenAI error body; the engine keeps serving.
"""
import pydantic
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from jpaged.entrypoints.protocol import APIError

TRAINING_ROUTES = ("/pause", "/resume", "/sleep", "/wake_up", "/update_weights", "/is_paused", "/is_sleeping")


class UpdateWeightsRequest(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    path: str


def _query_flag(raw: Request, name: str) -> bool:
    value = raw.query_params.get(name, "false").lower()
    if value not in ("true", "false", "1", "0"):
        raise APIError(400, f"{name}: expected true or false, got {value!r}", param=name)
    return value in ("true", "1")


def add_training_routes(app: FastAPI, serving, *, enable_weight_updates: bool) -> None:
    """Adds the routes to ``app`` (``serving``: its `OpenAIServing`, for body parsing and the engine)."""
    engine = serving.engine

    async def run(call):
        try:
            await call
        except ValueError as e:
            raise APIError(400, str(e)) from None
        except RuntimeError as e:
            raise APIError(409, str(e), code="conflict") from None
        return JSONResponse({"status": "ok"})

    @app.post("/pause")
    async def pause(raw: Request):
        return await run(engine.pause_generation(abort=_query_flag(raw, "abort")))

    @app.post("/resume")
    async def resume():
        return await run(engine.resume_generation())

    @app.post("/sleep")
    async def sleep(raw: Request):
        level = raw.query_params.get("level", "1")
        if level not in ("1", "2"):
            raise APIError(400, f"level: must be 1 or 2, got {level!r}", param="level")
        return await run(engine.sleep(int(level)))

    @app.post("/wake_up")
    async def wake_up():
        return await run(engine.wake_up())

    @app.post("/update_weights")
    async def update_weights(raw: Request):
        if not enable_weight_updates:
            raise APIError(403, "weight updates are off: start the server with --enable_weight_updates",
                           type="permission_error")
        body = await serving.parse(raw, UpdateWeightsRequest)
        return await run(engine.update_weights(body.path))

    @app.get("/is_paused")
    async def is_paused():
        return {"is_paused": engine.is_paused}

    @app.get("/is_sleeping")
    async def is_sleeping():
        return {"is_sleeping": bool(engine.engine.sleep_level)}
