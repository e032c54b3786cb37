"""jpaged's one logger, ``logging.getLogger("jpaged")``, and its set-up, done by the engine at start.

`configure_logging` gives the logger its own handler on stderr (lines ``jpaged: ...``, INFO and up,
as vLLM prints its start-up facts; not propagated, so an application's root handler does not print
them twice) unless it has one already, and drops two library messages that are not for jpaged's
users. Importing jpaged configures nothing.
"""
import logging

logger = logging.getLogger("jpaged")


class _DropMessage(logging.Filter):
    """Drops the records whose message starts with ``prefix``, at ``max_level`` or below."""

    def __init__(self, prefix: str, max_level: int):
        super().__init__()
        self.prefix, self.max_level = prefix, max_level

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno <= self.max_level and str(record.msg).startswith(self.prefix))


_configured = False


def configure_logging() -> None:
    """Idempotent; leaves a handler the application gave the "jpaged" logger alone."""
    global _configured
    if _configured:
        return
    _configured = True
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("jpaged: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    # JAX probes every platform plugin it finds and logs at INFO each one it cannot start ("Unable to
    # initialize backend 'tpu': ... libtpu.so"); a platform that was asked for (JAX_PLATFORMS) still raises.
    logging.getLogger("jax._src.xla_bridge").addFilter(_DropMessage("Unable to initialize backend", logging.INFO))
    # transformers imported without torch (jpaged never needs it) advises that "PyTorch was not found".
    logging.getLogger("transformers").addFilter(_DropMessage("PyTorch was not found", logging.WARNING))
