"""A trainer-side client of a fleet of bridges, given the control plane's address (issue 21).

``AsyncFleetClient("control:50061")`` asks the control plane (``primerl.v1.Control``) for the live bridges of a
model, starts each episode on the least-loaded one, and sends the episode's Steps and EndEpisode straight to
the bridge that owns it (no forwarding hop). When that bridge is unreachable (``UNAVAILABLE``: it died), the
call is sent once more, to the owner the control plane names now or to another live bridge, which takes the
episode over from Redis (persistence on); the trainer sees no error, and ``retries`` counts these. Any other
error is raised as it is (``rl_client.errors``).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, TypeVar

import grpc

from proto.primerl.v1 import control_pb2 as cpb
from proto.primerl.v1 import control_pb2_grpc as cpb_grpc
from rl_client.client import AsyncBridgeClient
from rl_client.errors import UnavailableError, from_rpc_error
from rl_client.types import Chunk, Started, Trajectory, TurnResult

T = TypeVar("T")


class AsyncFleetClient:
    """Episodes over the bridges the control plane at ``control`` lists (see module docstring)."""

    def __init__(self, control: str, model: str = "", *, token: str | None = None, timeout: float = 600.0) -> None:
        self.model = model
        self.timeout = timeout
        self._token = token
        self._control = grpc.aio.insecure_channel(control)
        self._stub: cpb_grpc.ControlAsyncStub = cpb_grpc.ControlStub(self._control)
        self._clients: dict[str, AsyncBridgeClient] = {}  # bridge address -> its client
        self._owner: dict[str, str] = {}  # episode id -> the address of the bridge that owns it
        self.retries = 0  # calls sent again to another bridge after UNAVAILABLE

    def _client(self, address: str) -> AsyncBridgeClient:
        if address not in self._clients:
            self._clients[address] = AsyncBridgeClient(address, token=self._token, timeout=self.timeout)
        return self._clients[address]

    async def bridges(self) -> list[cpb.FleetBridge]:
        """The live bridges (of ``model``), least loaded first."""
        try:
            listed = await self._stub.ListBridges(cpb.ListBridgesRequest(model=self.model), timeout=10)
        except grpc.aio.AioRpcError as err:
            raise from_rpc_error(err) from None
        if not listed.bridges:
            raise UnavailableError(grpc.StatusCode.UNAVAILABLE, f"no live bridge serves model {self.model!r}")
        return sorted(listed.bridges, key=lambda b: (b.load, b.address))

    async def _owner_of(self, episode_id: str, avoid: str = "") -> str:
        known = self._owner.get(episode_id, "")
        if known and known != avoid:
            return known
        located = await self._stub.LocateEpisode(cpb.LocateEpisodeRequest(episode_id=episode_id), timeout=10)
        if located.address and located.address != avoid:
            return located.address
        others = [b.address for b in await self.bridges() if b.address != avoid]
        if not others:
            raise UnavailableError(grpc.StatusCode.UNAVAILABLE, f"no live bridge other than {avoid} to take over")
        return others[0]

    async def _call(self, episode_id: str, call: Callable[[AsyncBridgeClient], Awaitable[T]]) -> T:
        address = await self._owner_of(episode_id)
        try:
            return await call(self._client(address))
        except UnavailableError:
            self._owner.pop(episode_id, None)
            address = await self._owner_of(episode_id, avoid=address)
            self.retries += 1
            result = await call(self._client(address))
            self._owner[episode_id] = address
            return result

    async def start_episode(self, *args: Any, **kwargs: Any) -> Started:
        """``AsyncBridgeClient.start_episode`` on the least-loaded live bridge."""
        address = (await self.bridges())[0].address
        started = await self._client(address).start_episode(*args, **kwargs)
        for episode_id in started.episode_ids:
            self._owner[episode_id] = address
        return started

    async def step(self, episode_id: str, *args: Any, **kwargs: Any) -> TurnResult:
        return await self._call(episode_id, lambda c: c.step(episode_id, *args, **kwargs))

    async def stream_step(self, episode_id: str, *args: Any, **kwargs: Any) -> AsyncGenerator[Chunk, None]:
        """Streamed Step on the owner; sent again elsewhere only if the owner was gone before any chunk."""
        address = await self._owner_of(episode_id)
        sent = False
        try:
            async for chunk in self._client(address).stream_step(episode_id, *args, **kwargs):
                sent = True
                yield chunk
            return
        except UnavailableError:
            if sent:
                raise
        self._owner.pop(episode_id, None)
        address = await self._owner_of(episode_id, avoid=address)
        self.retries += 1
        self._owner[episode_id] = address
        async for chunk in self._client(address).stream_step(episode_id, *args, **kwargs):
            yield chunk

    async def end_episode(self, episode_id: str, *args: Any, **kwargs: Any) -> Trajectory:
        trajectory = await self._call(episode_id, lambda c: c.end_episode(episode_id, *args, **kwargs))
        self._owner.pop(episode_id, None)
        return trajectory

    async def update_weights(self, checkpoint_path: str = "", **kwargs: Any) -> int:
        """One fleet-wide update, through the least-loaded bridge."""
        return await self._client((await self.bridges())[0].address).update_weights(checkpoint_path, **kwargs)

    async def close(self) -> None:
        for client in self._clients.values():
            await client.close()
        await self._control.close(None)
