"""The agents by name: ``make_agent`` builds any of ``AGENTS``.

``random`` (the grader's floor) and ``heuristic`` (the reference) are ``llmserve.baselines``'s;
``make_agent("ppo", weights=DIR)`` is the trained policy of ``llmserve/ppo.py``;
``make_agent("llm")`` a chat model behind ``$OPENAI_BASE_URL`` (``llmserve/llm.py``). Both are imported only
when asked for (torch, openai).
"""

from __future__ import annotations

from llmserve.baselines import Agent, HeuristicAgent, RandomAgent

AGENTS = ("ppo", "heuristic", "random", "llm")


def make_agent(name: str, seed: int = 0, weights: str | None = None) -> Agent:
    """``ppo`` loads its per-task weights from ``weights`` (default ``llmserve.ppo.DEFAULT_OUT``);
    ``llm`` reads its endpoint from the environment (``LLMConfig.from_env``; ``LLMEndpointError`` without one)."""
    if name == "random":
        return RandomAgent(seed)
    if name == "heuristic":
        return HeuristicAgent()
    if name == "ppo":
        from llmserve.ppo import PPOAgent  # torch only when asked for

        return PPOAgent(weights)
    if name == "llm":
        from llmserve.llm import LLMAgent, LLMConfig

        return LLMAgent(LLMConfig.from_env())
    raise ValueError(f"unknown agent {name!r}; agents: {', '.join(AGENTS)}")
