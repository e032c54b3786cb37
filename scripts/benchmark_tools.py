"""What a forced tool call's grammar costs: TTFT and output tok/s of 32 concurrent streamed chat
requests with ``tool_choice="required"`` and a 10-field schema, against the same requests without
tools and with the same tools under ``tool_choice="auto"`` (the same prompt, no grammar).

  python scripts/benchmark_tools.py                          # the embedded SmolLM2-135M-Instruct
  python scripts/benchmark_tools.py --model path/to/hf_dir --num_streams 32 --max_tokens 128

The server runs in this process (uvicorn on 127.0.0.1, a free port) with a ChatML template that
renders tools; the requests go through the `openai` async client. The unconstrained runs use
``ignore_eos`` with ``max_tokens``; the required run ends when its call is complete (capped at
``--required_max_tokens``). Output tok/s is the sum over streams of completion tokens / the longest
stream's time from its first chunk to its end; the grammar's cost is the required run's against the
``tool_choice="auto"`` run (equal prompts). Every required call is
checked against its schema with jsonschema.

The modes run in ``--repeats`` rounds, interleaved (round 1 in the order of ``--modes``, round 2
reversed, and so on), so that a load that drifts over the run falls on both sides of each pair.
Each round prints one line per mode; the end prints, per mode, the median over rounds of its TTFT
median and output tok/s, and the grammar's cost as the median over rounds of the (required,
tools_auto) pair's ratio:

  python scripts/benchmark_tools.py --repeats 7     # BENCH grammar_cost_median ... is the figure
"""
import asyncio
import json
import logging
import socket
import threading
import time

import numpy as np
from absl import app, flags

from jpaged.agents.templates import CHATML_TOOLS_TEMPLATE

F = flags.FLAGS
flags.DEFINE_string("model", None, "Model (default: the embedded SmolLM2-135M-Instruct)")
flags.DEFINE_integer("num_streams", 32, "Concurrent streamed requests per mode")
flags.DEFINE_integer("max_tokens", 128, "Output tokens of the unconstrained runs (the required run's cap)")
flags.DEFINE_integer("num_kv_blocks", 2048, "KV pool blocks")
flags.DEFINE_integer("max_model_len", 2048, "Longest sequence")
flags.DEFINE_integer("required_max_tokens", 256, "Cap of the required run (a 10-field call is ~100 tokens)")
flags.DEFINE_list("modes", ["no_tools", "tools_auto", "required"], "Which runs, in order")
flags.DEFINE_integer("repeats", 5, "Rounds of all the modes (interleaved; the figures are medians over rounds)")

FIELDS = {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo", "Lima"]},
          "days": {"type": "integer", "minimum": 1, "maximum": 14},
          "metric": {"type": "boolean"},
          "lat": {"type": "number", "minimum": -90, "maximum": 90},
          "lon": {"type": "number", "minimum": -180, "maximum": 180},
          "hourly": {"type": "boolean"},
          "lang": {"type": "string", "enum": ["en", "fr", "it", "no", "es"]},
          "alerts": {"type": "boolean"},
          "units": {"type": "string", "enum": ["si", "us", "uk"]},
          "note": {"type": "string", "maxLength": 16}}
TOOL = {"type": "function", "function": {"name": "get_forecast", "description": "A weather forecast",
                                         "parameters": {"type": "object", "properties": FIELDS,
                                                        "required": list(FIELDS), "additionalProperties": False}}}
MESSAGES = [{"role": "user", "content": "What will the weather be in Rome for the next five days?"}]


def start_server(app_):
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app_, log_level="warning"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return server, f"http://127.0.0.1:{sock.getsockname()[1]}/v1"


async def one(client, mode: str) -> dict:
    kwargs = dict(model="bench", messages=MESSAGES, temperature=0, max_tokens=F.max_tokens, stream=True,
                  stream_options={"include_usage": True})
    if mode == "required":
        kwargs.update(tools=[TOOL], tool_choice="required", max_tokens=F.required_max_tokens)
    else:
        kwargs["extra_body"] = {"ignore_eos": True}
        if mode == "tools_auto":
            kwargs.update(tools=[TOOL], tool_choice="auto")
    start, first, tokens, arguments, finish = time.perf_counter(), None, 0, [], None
    async for chunk in await client.chat.completions.create(**kwargs):
        if chunk.choices and first is None:
            first = time.perf_counter()
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for call in choice.delta.tool_calls or ():
                if call.function is not None and call.function.arguments:
                    arguments.append(call.function.arguments)
    return {"ttft": first - start, "decode_s": time.perf_counter() - first, "tokens": tokens,
            "arguments": "".join(arguments), "finish_reason": finish}


async def run_mode(base_url: str, mode: str, num_streams: int | None = None) -> list[dict]:
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=3600)
    try:
        return await asyncio.gather(*(one(client, mode) for _ in range(num_streams or F.num_streams)))
    finally:
        await client.close()


def measure(base_url: str, mode: str, round_: int, jsonschema) -> tuple[float, float]:
    """One run of ``mode`` (``num_streams`` concurrent streams): its TTFT median and output tok/s."""
    records = asyncio.run(run_mode(base_url, mode))
    if mode == "required":
        calls = [r for r in records if r["finish_reason"] == "tool_calls"]  # not cut by the cap
        for r in calls:
            jsonschema.validate(json.loads(r["arguments"]), TOOL["function"]["parameters"])
        print(f"BENCH required: {len(calls)} of {len(records)} streams ended in a schema-valid call", flush=True)
    ttft = np.array([r["ttft"] for r in records])
    tok_s = sum(r["tokens"] for r in records) / max(max(r["decode_s"] for r in records), 1e-9)
    print(f"BENCH round={round_} mode={mode} streams={F.num_streams} ttft_mean_s={ttft.mean():.3f} "
          f"ttft_p50_s={np.median(ttft):.3f} output_tok_s={tok_s:.1f} "
          f"mean_output_tokens={np.mean([r['tokens'] for r in records]):.1f}", flush=True)
    return float(np.median(ttft)), tok_s


def main(argv):
    del argv
    import jsonschema

    from jpaged import LLM
    from jpaged.entrypoints.async_engine import AsyncLLMEngine
    from jpaged.entrypoints.openai_server import create_app

    for name in ("httpx", "httpx2", "openai"):
        logging.getLogger(name).setLevel(logging.WARNING)
    kwargs = dict(num_kv_blocks=F.num_kv_blocks, max_model_len=F.max_model_len, max_num_seqs=F.num_streams)
    llm = LLM(F.model, **kwargs) if F.model else LLM(**kwargs)
    engine = AsyncLLMEngine(llm.llm_engine)
    server, base_url = start_server(create_app(engine, served_model_name="bench", chat_template=CHATML_TOOLS_TEMPLATE,
                                                  tool_call_parser="hermes", enable_auto_tool_choice=True))
    for mode in F.modes:  # warm-up: compilations, prefix cache, the grammar and llguidance's tokenizer view
        asyncio.run(run_mode(base_url, mode, 2))
    rounds = []  # per round: {mode: (TTFT median, output tok/s)}
    for r in range(F.repeats):
        order = F.modes if r % 2 == 0 else F.modes[::-1]
        rounds.append({mode: measure(base_url, mode, r, jsonschema) for mode in order})
    for mode in F.modes:
        print(f"BENCH median_of_rounds mode={mode} rounds={F.repeats} "
              f"ttft_p50_s={np.median([x[mode][0] for x in rounds]):.3f} "
              f"output_tok_s={np.median([x[mode][1] for x in rounds]):.1f}", flush=True)
    if "required" in F.modes and "tools_auto" in F.modes:
        ttft = [x["required"][0] / x["tools_auto"][0] - 1 for x in rounds]
        tok_s = [x["required"][1] / x["tools_auto"][1] - 1 for x in rounds]
        print(f"BENCH grammar_cost_median rounds={F.repeats} ttft_p50={np.median(ttft):+.1%} "
              f"output_tok_s={np.median(tok_s):+.1%} (per round: ttft "
              + " ".join(f"{v:+.0%}" for v in ttft) + "; tok/s " + " ".join(f"{v:+.0%}" for v in tok_s) + ")",
              flush=True)
    server.should_exit = True


if __name__ == "__main__":
    app.run(main)
