"""Ways to run jpaged: the offline `LLM` (``llm``), the async engine (``async_engine``), the
OpenAI-compatible server (``openai_server``, ``serve``), the command-line tools' shared flags
(``engine_flags``, ``dataclass_flags``, ``flag_help``) and the ahead-of-time compile (``aot``)."""
