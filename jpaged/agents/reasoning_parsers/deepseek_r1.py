"""DeepSeek-R1 (and its distills): the template opens ``<think>``; the output reasons up to ``</think>``."""
from jpaged.agents.reasoning_parsers.base import ReasoningParser


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    starts_in_reasoning = True
