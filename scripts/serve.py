"""The OpenAI-compatible server (the same as the console script ``jpaged-serve``).

  python scripts/serve.py --model path/to/hf_dir --host 127.0.0.1 --port 8000 [--api_key KEY]

Every engine flag of generate.py, plus --host, --port, --api_key, --served_model_name,
--max_queued_requests, --chat_template, --shutdown_timeout (``--help`` lists them).
"""
from jpaged.entrypoints.serve import run

if __name__ == "__main__":
    run()
