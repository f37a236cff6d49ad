"""``InferenceModule``: generation and teacher-forced scoring, through a bridge or on a local model.

Backends:

* a bridge (``"host:port"`` or a ``rl_client.BridgeClient``): ``generate`` opens one episode per prompt
  (``StartEpisode`` + ``Step``, then discards it), ``get_logprobs`` / ``get_logits`` call ``ScoreTokens``
  (teacher forcing, no sampling, no episode state; UNIMPLEMENTED from engines that cannot score), and
  ``batch_generate_with_tools`` drives each environment with the Env Hub's ``ToolLoop``;
* a local Hugging Face model (``torch.nn.Module``): the same calls run on it (``score_forward`` is the
  engine's own scoring forward), ``update_weights`` is a no-op because the trainer and sampler share it.

Prompts are a string (one user message), chat messages, or token ids; responses are a string (encoded
without special tokens, appended to the rendered prompt) or token ids. Every call is synchronous; batch
calls run their items concurrently on the bridge (``rl_client.run_episodes``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from core.types import Message
from engines.chat import HFTokenizer
from engines.scoring import score_forward
from envhub import EnvHubConfig, Environment, ToolLoop
from rl_client import AsyncBridgeClient, BridgeClient, Trajectory

PromptLike = str | Sequence[Mapping[str, str]] | Sequence[Message] | Sequence[int]
ResponseLike = str | Sequence[int]


@dataclass
class Generation:
    """One sampled completion."""

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: npt.NDArray[np.float32]
    text: str
    policy_version: int = 0
    finish_reason: str = "stop"


@dataclass
class ToolEpisode:
    """One environment episode run by ``batch_generate_with_tools``."""

    texts: list[str]
    reward: float
    trajectory: Trajectory | None  # the bridge's token record (None on a local model)
    reasons: list[str] = field(default_factory=list)


def as_messages(prompt: PromptLike) -> list[Message]:
    if isinstance(prompt, str):
        return [Message(role="user", content=prompt)]
    return [m if isinstance(m, Message) else Message(str(m["role"]), str(m["content"])) for m in prompt]  # type: ignore[index]


def message_dicts(messages: Sequence[Message]) -> list[dict[str, str]]:
    """Chat messages as the bridge client takes them."""
    return [{"role": m.role, "content": m.content, "name": m.name} for m in messages]


def _is_ids(x: object) -> bool:
    return isinstance(x, np.ndarray) or (
        isinstance(x, Sequence) and not isinstance(x, str) and bool(x) and isinstance(x[0], int | np.integer)
    )


class InferenceModule:
    """Generation, ``get_logprobs``, ``get_logits`` and tool episodes over a bridge or a local model."""

    def __init__(
        self,
        backend: str | BridgeClient | Any,
        *,
        tokenizer: HFTokenizer | None = None,
        sampling: Mapping[str, Any] | None = None,
        timeout: float = 600.0,
    ) -> None:
        self.sampling = dict(sampling or {"temperature": 1.0, "max_tokens": 64})
        self.client: BridgeClient | None = None
        self.model: Any = None
        self._owns = isinstance(backend, str)
        if isinstance(backend, str):
            self.client = BridgeClient(backend, timeout=timeout)
            self.client.wait_until_ready(timeout)
        elif isinstance(backend, BridgeClient):
            self.client = backend
        else:
            self.model = backend
        self.tokenizer = tokenizer or self._default_tokenizer()

    def _default_tokenizer(self) -> HFTokenizer:
        from transformers import AutoTokenizer

        from engines.model_store import resolve_model_dir

        eos: tuple[int, ...]
        if self.model is not None:
            e = self.model.config.eos_token_id
            eos = tuple(e) if isinstance(e, list) else (int(e),)
            path = getattr(self.model, "name_or_path", "") or str(resolve_model_dir(None))
        else:
            assert self.client is not None
            eos = tuple(self.client.server_info().models[0].eos_token_ids)
            path = str(resolve_model_dir(None))
        return HFTokenizer(AutoTokenizer.from_pretrained(path), eos)

    # -- token ids -------------------------------------------------------------------------------

    def prompt_ids(self, prompt: PromptLike, tools: Sequence[str] = ()) -> list[int]:
        if _is_ids(prompt):
            return [int(t) for t in prompt]  # type: ignore[arg-type]
        return self.tokenizer.render_prompt(as_messages(prompt), tools)

    def response_ids(self, response: ResponseLike) -> list[int]:
        return self.tokenizer.encode(response) if isinstance(response, str) else [int(t) for t in response]

    @property
    def policy_version(self) -> int:
        if self.client is None:
            return 0
        return int(self.client.server_info().models[0].policy_version)

    # -- generation ------------------------------------------------------------------------------

    def generate(self, prompts: Sequence[PromptLike], **sampling: Any) -> list[Generation]:
        """One sampled completion per prompt (``sampling`` overrides the module's defaults).

        On a bridge, chat prompts are rendered by the bridge's own tokenizer (token-id prompts are sent as is).
        """
        params = self.sampling | sampling
        if self.client is None:
            return [self._generate_local(self.prompt_ids(p), params) for p in prompts]
        wire = [[int(t) for t in p] if _is_ids(p) else message_dicts(as_messages(p)) for p in prompts]  # type: ignore[arg-type]

        async def one(client: AsyncBridgeClient, prompt: Any) -> Generation:
            started = await client.start_episode(prompt, sampling=params)
            try:
                turn = await client.step(started.episode_id)
            except BaseException:
                await client.discard_episode(started.episode_id)
                raise
            traj = await client.end_episode(started.episode_id)
            prompt_ids = [int(t) for t in traj.token_ids[: traj.prompt_length]]
            return Generation(
                prompt_ids,
                [int(t) for t in turn.token_ids],
                turn.logprobs,
                turn.text,
                turn.policy_version,
                turn.finish_reason,
            )

        return self._many(wire, one, len(wire))

    def _many(self, items: Sequence[Any], fn: Any, concurrency: int) -> list[Any]:
        """``fn(client, item)`` for every item on the bridge; the first failure is raised as itself."""
        assert self.client is not None
        try:
            return self.client.run_episodes(items, fn, concurrency=max(1, concurrency))
        except BaseExceptionGroup as group:
            first: BaseException = group
            while isinstance(first, BaseExceptionGroup):
                first = first.exceptions[0]
            raise first from None

    def _generate_local(self, prompt: list[int], params: Mapping[str, Any]) -> Generation:
        import torch

        temperature = float(params.get("temperature", 1.0))
        seed = params.get("seed")
        gen = torch.Generator().manual_seed(int(seed)) if seed is not None else None
        ids = list(prompt)
        out: list[int] = []
        lps: list[float] = []
        eos = set(self.tokenizer.eos_token_ids)
        with torch.inference_mode():
            for _ in range(int(params.get("max_tokens", 64))):
                logits = self.model(input_ids=torch.tensor([ids])).logits[0, -1].float()
                logp = torch.log_softmax(logits / max(temperature, 1e-6), dim=-1)
                tok = int(logp.argmax()) if temperature == 0 else int(torch.multinomial(logp.exp(), 1, generator=gen))
                out.append(tok)
                lps.append(float(logp[tok]))
                ids.append(tok)
                if tok in eos:
                    break
        return Generation(prompt, out, np.asarray(lps, dtype=np.float32), self.tokenizer.decode(out))

    # -- scoring ---------------------------------------------------------------------------------

    def _pairs(self, prompts: Sequence[PromptLike], responses: Sequence[ResponseLike]) -> list[tuple[list[int], int]]:
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
        out = []
        for p, r in zip(prompts, responses, strict=True):
            pid, rid = self.prompt_ids(p), self.response_ids(r)
            if not rid:
                raise ValueError("a response needs at least one token to score")
            out.append((pid + rid, len(pid)))
        return out

    def _score(
        self, prompts: Sequence[PromptLike], responses: Sequence[ResponseLike], temperature: float, logits: bool
    ) -> list[tuple[npt.NDArray[np.float32], npt.NDArray[np.float32] | None]]:
        pairs = self._pairs(prompts, responses)
        if self.client is None:
            return [score_forward(self.model, ids, start, temperature, logits) for ids, start in pairs]

        async def one(client: AsyncBridgeClient, pair: tuple[list[int], int]) -> tuple[Any, Any]:
            resp = await client.score_tokens(pair[0], pair[1], temperature=temperature, logits=logits)
            lp = np.asarray(resp.logprobs, dtype=np.float32)
            lg = np.frombuffer(resp.logits, dtype="<f4").reshape(lp.size, resp.vocab_size) if logits else None
            return lp, lg

        return self._many(pairs, one, 8)

    def get_logprobs(
        self, prompts: Sequence[PromptLike], responses: Sequence[ResponseLike], temperature: float = 1.0
    ) -> list[npt.NDArray[np.float32]]:
        """log p(response token | prompt, earlier response tokens) under the current weights, per response."""
        return [lp for lp, _ in self._score(prompts, responses, temperature, False)]

    def get_logits(
        self, prompts: Sequence[PromptLike], responses: Sequence[ResponseLike]
    ) -> list[npt.NDArray[np.float32]]:
        """The raw logits ``[len(response), vocab]`` that predicted each response token."""
        return [lg for _, lg in self._score(prompts, responses, 1.0, True) if lg is not None]

    # -- tools -----------------------------------------------------------------------------------

    def batch_generate_with_tools(
        self,
        envs: Sequence[Environment],
        *,
        seeds: Sequence[int] | None = None,
        loop: Any = None,
        **sampling: Any,
    ) -> list[ToolEpisode]:
        """Run one episode of each environment: the Env Hub ``ToolLoop`` executes the tool calls of every turn.

        ``loop`` is an ``envhub`` loop config (``EnvHubConfig().loop``: the tool-call bounds).
        """
        if self.client is None:
            raise NotImplementedError("batch_generate_with_tools needs a bridge backend")
        params = self.sampling | sampling
        items = list(zip(envs, seeds or range(len(envs)), strict=False))

        async def one(client: AsyncBridgeClient, item: tuple[Environment, int]) -> ToolEpisode:
            env, seed = item
            opening = await env.reset(seed=seed)
            tools = [t.to_json() for t in opening.tools]
            started = await client.start_episode(message_dicts(opening.messages), sampling=params, tools=tools)
            tool_loop = ToolLoop(env, loop or EnvHubConfig().loop)
            texts, reasons, observation = [], [], None
            while True:
                turn = await client.step(started.episode_id, observation)
                decision = await tool_loop.on_turn(turn.text)
                texts.append(turn.text)
                reasons.append(decision.reason)
                if not decision.should_continue:
                    break
                observation = message_dicts(decision.observation)
            reward = float(decision.reward or 0.0)
            return ToolEpisode(texts, reward, await client.end_episode(started.episode_id, reward=reward), reasons)

        return self._many(items, one, len(items))

    # -- weights ---------------------------------------------------------------------------------

    def update_weights(self, model: Any, directory: str | Path) -> int:
        """Push ``model``'s weights to the bridge (``UpdateWeights``); returns the new policy version."""
        if self.client is None:
            return 0  # the local backend samples from the trained model itself
        from grpo.policy import save_for_bridge

        return self.client.update_weights(str(save_for_bridge(model, directory).resolve()))

    def close(self) -> None:
        if self._owns and self.client is not None:
            self.client.close()


__all__ = ["Generation", "InferenceModule", "ToolEpisode", "as_messages", "message_dicts"]
