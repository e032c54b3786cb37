"""One HTTP request through an ASGI app in-process, its response as a stream of parts.

A Ray Serve replica answers the gateway's forwarded requests with its own OpenAI app this way, so
every route, limit and check is the one `scripts/serve.py` serves. Closing the stream early (the
client left) is a disconnect to the app: its requests are aborted as over a socket.
"""
import asyncio
import contextlib

START, BODY = "start", "body"


async def call_asgi(app, method: str, path: str, query: bytes, headers: list, body: bytes, client=("gateway", 0)):
    """Yields ``("start", status, headers)`` once, then ``("body", bytes)`` parts until the
    response ends. ``headers`` are ``(name, value)`` byte pairs, as ASGI has them."""
    sent: asyncio.Queue = asyncio.Queue()
    disconnected = asyncio.Event()
    body_read = False

    async def receive():
        nonlocal body_read
        if not body_read:
            body_read = True
            return {"type": "http.request", "body": body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        await sent.put(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
             "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "", "query_string": query,
             "headers": [(bytes(k).lower(), bytes(v)) for k, v in headers], "client": client,
             "server": ("jpaged-replica", 0)}
    task = asyncio.create_task(app(scope, receive, send))
    try:
        while True:
            get = asyncio.ensure_future(sent.get())
            await asyncio.wait({get, task}, return_when=asyncio.FIRST_COMPLETED)
            if not get.done():
                get.cancel()
                if sent.empty():
                    task.result()  # the app's exception, if it raised one
                    return  # it returned without finishing a response
                continue
            message = get.result()
            if message["type"] == "http.response.start":
                yield START, message["status"], [(bytes(k), bytes(v)) for k, v in message.get("headers", ())]
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield BODY, bytes(message["body"])
                if not message.get("more_body", False):
                    return
    finally:
        disconnected.set()
        if not task.done():
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(task), 5.0)
            if not task.done():
                task.cancel()
