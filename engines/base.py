"""The engine protocol: the only thing the bridge knows about an inference engine.

An engine takes token ids and returns sampled token ids with their logprobs, streamed.
Engines never see protobuf, and never re-tokenize the history they are given.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from typing import Protocol, runtime_checkable

from core.types import EngineCounters, EngineHealth, EngineInfo, GenerateRequest, Message, TokenChunk, WeightUpdate


@runtime_checkable
class Tokenizer(Protocol):
    """Text <-> ids, and chat rendering that is append-only across turns."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def render_prompt(self, messages: Sequence[Message], tool_schemas: Sequence[str] = ()) -> list[int]:
        """Render a conversation's opening messages, ending with the assistant generation prompt."""
        ...

    def render_continuation(self, messages: Sequence[Message], history: Sequence[int]) -> list[int]:
        """Render messages that follow ``history``, ending with the generation prompt.

        The result is appended to the episode's ids as they are (append-only bridging):
        earlier tokens are never re-rendered. ``history`` lets the renderer close an
        assistant turn that ended without its end-of-turn marker (e.g. on max_tokens).
        """
        ...


class Engine(Protocol):
    """An inference engine replica (in-process or remote)."""

    @property
    def info(self) -> EngineInfo: ...

    @property
    def tokenizer(self) -> Tokenizer | None: ...

    @property
    def counters(self) -> EngineCounters:
        """Prefill/cached/generated token counters (read by tests, metrics and benchmarks)."""
        ...

    @property
    def policy_version(self) -> int: ...

    def generate(self, request: GenerateRequest) -> AsyncGenerator[TokenChunk, None]:
        """Stream the continuation of ``request.token_ids``.

        Cancelling the consumer (or calling ``abort``) stops work at the next token. The
        last chunk carries ``finish_reason`` and ``usage``.
        """
        ...

    async def abort(self, request_id: str) -> None:
        """Stop a running request; its stream ends with finish reason ABORT."""

    async def health(self) -> EngineHealth: ...

    async def update_weights(self, update: WeightUpdate) -> None:
        """Swap in new weights; raise ``core.errors.Unimplemented`` if impossible."""

    async def release(self, episode_id: str) -> None:
        """Forget an ended episode's state (KV); a no-op for stateless engines."""

    async def close(self) -> None: ...
