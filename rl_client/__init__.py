"""Trainer-side client of the PrimeRL bridge.

from rl_client import BridgeClient
with BridgeClient("localhost:50051") as bridge:
    ep = bridge.start_episode([{"role": "user", "content": "What is 2+2?"}], sampling={"temperature": 0})
    turn = bridge.step(ep.episode_id)
    traj = bridge.end_episode(ep.episode_id, reward=1.0)
"""

from rl_client.client import AsyncBridgeClient, BridgeClient, run_episodes
from rl_client.errors import BridgeError
from rl_client.fleet import AsyncFleetClient
from rl_client.proof import WeightProof, weight_proof
from rl_client.types import Chunk, EnvStatus, Message, Sampling, Started, Trajectory, TurnResult

__all__ = [
    "AsyncBridgeClient",
    "AsyncFleetClient",
    "BridgeClient",
    "BridgeError",
    "Chunk",
    "EnvStatus",
    "Message",
    "Sampling",
    "Started",
    "Trajectory",
    "TurnResult",
    "WeightProof",
    "run_episodes",
    "weight_proof",
]
