"""Ways to run jpaged: the OpenAI-compatible server (``openai_server``, ``serve``)."""
