"""The engine loop and what surrounds it: start-up, input and output processing and data
parallelism (its fronts, `LLM` and the async engine, are in `jpaged.entrypoints`)."""


def create_engine(config, **kwargs):
    """An `LLMEngine` for ``config``, or a `DataParallelEngine` of ``data_parallel_size`` of them."""
    if config.data_parallel_size > 1:
        from jpaged.engine.data_parallel import DataParallelEngine
        return DataParallelEngine(config, config.data_parallel_size, **kwargs)
    from jpaged.engine.llm_engine import LLMEngine
    return LLMEngine(config, **kwargs)
