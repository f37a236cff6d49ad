"""A weight update as a transaction on one bridge (issue 36): apply with no turn running, every replica proves the
weights it loaded (logprobs of a probe), commit only when all did; otherwise every replica goes back to its previous
weights and version and the call names the replica. Real toy engines (their "weights" are seeded tables, so two
seeds are two models that disagree on any probe); no server."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import numpy as np
import pytest

from core.errors import EngineUnavailable, FailedPrecondition, InvalidArgument, Unimplemented
from core.proof import WeightProof, default_probe, deviation
from core.types import SamplingOverrides, WeightUpdate
from engines.config import ToyConfig
from engines.scoring import ScoreRequest
from engines.toy import TOY_BASE_WEIGHTS, ToyEngine
from server.bridge import Bridge
from server.calls import EndRequest, StartRequest, StepRequest
from server.config import AdmissionConfig, SamplingDefaults

PROBE = default_probe(512)


def toy(seed: int = 0, replica: str = "toy-0", **config: object) -> ToyEngine:
    return ToyEngine(ToyConfig(seed=seed, supports_scoring=True, **config), replica=replica)  # type: ignore[arg-type]


async def probe(engine: ToyEngine) -> list[float]:
    return (await engine.score(ScoreRequest(PROBE, 1))).logprobs.tolist()


async def proof_for(*versions: int) -> WeightProof:
    """The caller's proof after loading ``versions`` in turn (a toy load perturbs the tables it holds): what its own
    copy of the weights gives the probe."""
    own = toy()
    for version in versions:
        await own.update_weights(WeightUpdate("ckpt", version))
    return WeightProof(PROBE, tuple(await probe(own)))


def phases(bridge: Bridge) -> dict[str, float]:
    """How many times each phase of ``primerl_weight_update_seconds`` was observed."""
    out: dict[str, float] = {}
    for family in bridge.metrics.registry.collect():
        if family.name == "primerl_weight_update_seconds":
            for s in family.samples:
                if s.name.endswith("_count"):
                    out[s.labels["phase"]] = s.value
    return out


async def test_a_caller_proof_that_every_replica_matches_commits() -> None:
    a, b = toy(replica="toy-0"), toy(replica="toy-1")
    bridge = Bridge([a, b], AdmissionConfig(), SamplingDefaults())
    assert await bridge.update_weights("ckpt", 0, False, proof=await proof_for(1)) == 1
    assert (a.policy_version, b.policy_version, bridge.policy_version) == (1, 1, 1)
    assert {"prepare", "drain", "apply", "verify", "pause", "held", "total"} <= phases(bridge).keys()
    assert "rollback" not in phases(bridge)


async def test_weights_that_differ_from_the_proof_roll_back_everywhere_to_the_previous_checkpoint() -> None:
    a, b = toy(replica="toy-0"), toy(replica="toy-1")
    bridge = Bridge([a, b], AdmissionConfig(), SamplingDefaults())
    assert await bridge.update_weights("one", 0, False) == 1  # no caller proof: the replicas agree with each other
    served = await probe(a)
    with pytest.raises(FailedPrecondition, match=r"replica 'toy-0' loaded the weights of version 2 but they fail") as e:
        await bridge.update_weights("two", 0, False, proof=await proof_for(1, 3))  # a proof of other weights
    assert "the caller's proof" in e.value.message and "back on its previous weights" in e.value.message
    assert (a.policy_version, b.policy_version) == (1, 1)
    assert await probe(a) == served and await probe(b) == served  # version 1's tables again, on both
    assert phases(bridge)["rollback"] == 1
    assert not bridge.paused
    assert await bridge.update_weights("two", 0, False, proof=await proof_for(1, 2)) == 2  # this one goes through


async def test_replicas_that_disagree_with_each_other_roll_back() -> None:
    a, b = toy(seed=0, replica="toy-0"), toy(seed=1, replica="toy-1")  # two different models behind one bridge
    bridge = Bridge([a, b], AdmissionConfig(), SamplingDefaults())
    before = await probe(b)
    with pytest.raises(FailedPrecondition, match=r"replica 'toy-1' .* in the other replicas'"):
        await bridge.update_weights("ckpt", 0, False)
    assert (a.policy_version, b.policy_version) == (0, 0) and await probe(b) == before


async def test_a_bad_proof_is_refused_before_anything_pauses_or_loads() -> None:
    a = toy()
    bridge = Bridge([a], AdmissionConfig(), SamplingDefaults())
    bad = [
        (WeightProof(PROBE, (-1.0,)), r"probe_logprobs has 1 values; it must have one per probe token .* \(8\)"),
        (WeightProof((), (-1.0,)), "without the probe_token_ids"),
        (WeightProof((1,), ()), "needs 2 to"),
        (WeightProof((1, 9999), ()), "probe_token_ids"),
        (WeightProof((1, 2), (0.5,)), r"probe_logprobs\[0\] = 0.5 is not a log-probability"),
        (WeightProof((1, 2), (), float("nan")), "probe_tolerance must be a finite number > 0"),
    ]
    for proof, message in bad:
        with pytest.raises(InvalidArgument, match=message):
            await bridge.update_weights("ckpt", 0, False, proof=proof)
    plain = ToyEngine(ToyConfig())  # cannot score: nothing to prove with
    with pytest.raises(Unimplemented, match=r"replicas \['local'\] \(toy\) cannot score a probe"):
        await Bridge([plain], AdmissionConfig(), SamplingDefaults()).update_weights("ckpt", 0, False, proof=PROOF0)
    assert a.policy_version == 0 and not {"held", "pause"} & phases(bridge).keys()
    # an engine that cannot score still updates without a proof (nothing to verify it with)
    assert await Bridge([plain], AdmissionConfig(), SamplingDefaults()).update_weights("ckpt", 0, False) == 1


PROOF0 = WeightProof(PROBE, ())


@dataclass
class Turn:
    tokens: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    step_ended: asyncio.Event = field(default_factory=asyncio.Event)  # its Step released (before EndEpisode)


async def _turn(bridge: Bridge, max_tokens: int, turn: Turn | None = None) -> Turn:
    """One episode of one greedy turn: its sampled tokens and the policy version of each."""
    turn = turn or Turn()
    started = await bridge.start_episode(StartRequest(prompt_ids=(10, 11, 12), sampling=_greedy(max_tokens)))
    episode_id = started.episode_ids[0]
    handle = await bridge.prepare_step(StepRequest(episode_id))
    try:
        async for _ in handle.updates():
            pass
    finally:
        await handle.close()  # the Step ends (what the gRPC handler does)
        turn.step_ended.set()
    result = await bridge.end_episode(EndRequest(episode_id))
    assert result.episode is not None
    turn.tokens, turn.versions = result.episode.token_ids[3:], result.episode.versions[3:]
    return turn


def _greedy(max_tokens: int) -> SamplingOverrides:
    return SamplingOverrides(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


async def _version_0_tokens(max_tokens: int, *versions: int) -> list[int]:
    """What the start-up weights (after loading ``versions`` in turn) decode greedily from the same prompt."""
    own = toy()
    for version in versions:
        await own.update_weights(WeightUpdate("ckpt", version))
    return (await _turn(Bridge([own], AdmissionConfig(), SamplingDefaults()), max_tokens)).tokens


async def test_no_token_is_sampled_between_apply_and_commit_and_a_paused_bridge_stays_paused() -> None:
    slow = toy(token_delay_s=0.01)
    bridge = Bridge([slow], AdmissionConfig(), SamplingDefaults())
    turn = Turn()
    running = asyncio.create_task(_turn(bridge, 40, turn))  # ~0.4 s of decoding
    await asyncio.sleep(0.1)
    assert await bridge.update_weights("ckpt", 0, False) == 1  # keep: waits for the running turn to end
    assert turn.step_ended.is_set()  # its Step had ended before the update returned
    await running
    assert turn.tokens == await _version_0_tokens(40) and set(turn.versions) == {0}  # all of it on version 0
    after = await _turn(bridge, 4)
    assert set(after.versions) == {1} and after.tokens != (await _version_0_tokens(4)) and not bridge.paused
    await bridge.pause(abort=False)  # an operator's pause outlives the update
    assert await bridge.update_weights("ckpt", 0, False) == 2
    assert bridge.paused


async def test_a_turn_that_outlasts_the_drain_is_aborted_with_its_tokens_on_the_old_version() -> None:
    slow = toy(token_delay_s=0.01)
    bridge = Bridge([slow], AdmissionConfig(weight_update_drain_s=0.05), SamplingDefaults())
    turn = Turn()
    running = asyncio.create_task(_turn(bridge, 400, turn))  # ~4 s: aborted after 0.05 s
    await asyncio.sleep(0.1)
    assert await bridge.update_weights("ckpt", 0, False) == 1
    assert turn.step_ended.is_set()
    await running
    assert 0 < len(turn.tokens) < 400 and set(turn.versions) == {0}
    assert turn.tokens == (await _version_0_tokens(400))[: len(turn.tokens)]  # every token from version 0's weights


async def test_a_reload_to_the_start_up_weights_also_waits_for_the_running_turns() -> None:
    slow = toy(token_delay_s=0.01)
    bridge = Bridge([slow], AdmissionConfig(), SamplingDefaults())
    assert await bridge.update_weights("ckpt", 0, False) == 1
    turn = Turn()
    running = asyncio.create_task(_turn(bridge, 40, turn))
    await asyncio.sleep(0.1)
    assert await bridge.reload_weights() == 2
    assert turn.step_ended.is_set()
    await running
    assert set(turn.versions) == {1} and turn.tokens == await _version_0_tokens(40, 1)  # version 1's weights throughout
    assert (await _turn(bridge, 40)).tokens == await _version_0_tokens(40)  # then the start-up weights again


async def test_replicas_load_and_prove_at_once_so_the_pause_lasts_the_slowest_not_the_sum() -> None:
    """Each replica is a server of its own. Each one's load (and then its score of the probe) only goes on once the
    other's has begun: one replica after the other, the update would never end."""
    a, b = toy(replica="toy-0"), toy(replica="toy-1")
    bridge = Bridge([a, b], AdmissionConfig(), SamplingDefaults())
    began = {(step, i): asyncio.Event() for step in ("update_weights", "score") for i in (0, 1)}

    def meet(engine: ToyEngine, i: int, step: str) -> None:
        original = getattr(engine, step)

        async def wrapped(arg: object) -> object:
            if isinstance(arg, WeightUpdate) and arg.policy_version != 1:
                return await original(arg)  # a rollback (the sequential code's, after the timeout) goes through
            began[step, i].set()
            await began[step, 1 - i].wait()
            return await original(arg)

        setattr(engine, step, wrapped)

    for i, engine in enumerate((a, b)):
        meet(engine, i, "update_weights")
        meet(engine, i, "score")
    try:
        async with asyncio.timeout(10):
            assert await bridge.update_weights("ckpt", 0, False, proof=await proof_for(1)) == 1
    except TimeoutError:
        pytest.fail(f"the replicas did not load and prove at once: {sorted(k for k, e in began.items() if e.is_set())}")
    assert (a.policy_version, b.policy_version, bridge.policy_version) == (1, 1, 1)


async def test_a_cancelled_update_rolls_every_replica_back_before_turns_resume() -> None:
    """The caller gone mid-update (its deadline, a disconnect): the replicas that loaded go back all the same."""
    a, b = toy(replica="toy-0"), toy(replica="toy-1", token_delay_s=0.0)
    bridge = Bridge([a, b], AdmissionConfig(), SamplingDefaults())
    served = await probe(b)
    original = b.update_weights

    async def slow_load(update: WeightUpdate) -> None:
        await original(update)
        if update.policy_version == 1:
            await asyncio.sleep(5)  # the new weights are in; the call is cancelled meanwhile

    b.update_weights = slow_load  # type: ignore[method-assign]
    call = asyncio.create_task(bridge.update_weights("ckpt", 0, False))
    await asyncio.sleep(0.2)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert (a.policy_version, b.policy_version, bridge.policy_version) == (0, 0, 0)
    assert await probe(b) == served and await probe(a) == served and not bridge.paused


async def test_a_replica_that_cannot_roll_back_is_fenced_and_left_out_of_the_version() -> None:
    a, b = toy(replica="toy-0"), toy(seed=1, replica="toy-1")  # they disagree: the update fails its proof
    bridge = Bridge([a, b], AdmissionConfig(), SamplingDefaults())
    original = b.update_weights

    async def no_way_back(update: WeightUpdate) -> None:
        if update.policy_version == 0:
            raise EngineUnavailable("toy-1 is gone")
        await original(update)

    b.update_weights = no_way_back  # type: ignore[method-assign]
    with pytest.raises(FailedPrecondition, match=r"back on its previous weights and version except \['toy-1'\]"):
        await bridge.update_weights("ckpt", 0, False)
    assert b.policy_version == 1 and bridge.policy_version == 0  # its label is not the bridge's version
    assert bridge.weights.tainted == {1} and bridge.router.replicas.healthy == [True, False]
    b.update_weights = original  # type: ignore[method-assign]
    assert await bridge.weights.rejoin(1) == ""  # reloaded with the committed (start-up) weights, version 0
    assert b.policy_version == 0 and not bridge.weights.tainted


def test_deviation_is_the_largest_absolute_difference_and_nan_fails() -> None:
    assert deviation([-1.0, -2.0, -3.0], [-1.0, -2.5, -3.1]) == (0.5, 1)
    assert deviation([-np.inf, -1.0], [-np.inf, -1.0]) == (0.0, 0)
    worst, at = deviation([-1.0, float("nan")], [-1.0, -1.0])
    assert worst == np.inf and at == 1


async def test_a_replica_back_on_its_start_up_weights_rejoins_only_after_proving_the_committed_ones() -> None:
    """What a vLLM replica restarted after a commit looks like from the bridge: it answers under the committed version
    (the adapter's label) but serves its start-up weights. Before it is back in rotation it must match the committed
    proof: the bridge reloads the committed checkpoint on it, and it proves it."""
    a, b = toy(replica="toy-0"), toy(replica="toy-1")
    bridge = Bridge([a, b], AdmissionConfig(), SamplingDefaults())
    assert await bridge.weights.rejoin(1) == ""  # nothing committed yet: the start-up weights are the served ones
    assert await bridge.update_weights("ckpt", 0, False) == 1
    committed = await probe(b)
    await b.update_weights(WeightUpdate(TOY_BASE_WEIGHTS, 1))  # "restarted": start-up tables, version label 1
    assert await probe(b) != committed
    assert await bridge.weights.rejoin(1) == ""  # reloaded and proven
    assert await probe(b) == committed and b.policy_version == 1


async def test_a_replica_that_cannot_prove_the_committed_weights_stays_out() -> None:
    a, b = toy(seed=0, replica="toy-0"), toy(seed=0, replica="toy-1")
    bridge = Bridge([a, b], AdmissionConfig(), SamplingDefaults())
    assert await bridge.update_weights("ckpt", 0, False) == 1
    b.config = b.config.model_copy(update={"seed": 5})  # from now on it loads another model's tables
    await b.update_weights(WeightUpdate("other", 7))
    await b.update_weights(WeightUpdate("elsewhere", 1))  # labelled version 1, but not version 1's tables
    why = await bridge.weights.rejoin(1)
    assert why.startswith("fails the proof of version 1 even after reloading ckpt: probe token")


async def test_score_tokens_waits_for_an_update_to_commit_and_an_update_for_the_scores_in_progress() -> None:
    from proto.primerl.v1 import primerl_pb2 as pb
    from server.scoring import score_tokens

    a = toy()
    bridge = Bridge([a], AdmissionConfig(), SamplingDefaults())
    original = a.update_weights

    async def slow_load(update: WeightUpdate) -> None:
        await original(update)
        await asyncio.sleep(0.3)  # loaded, not yet verified or committed

    a.update_weights = slow_load  # type: ignore[method-assign]
    update = asyncio.create_task(bridge.update_weights("ckpt", 0, False))
    await asyncio.sleep(0.1)
    scored = await score_tokens(bridge, pb.ScoreTokensRequest(token_ids=list(PROBE), start=1))
    assert update.done() and scored.policy_version == 1  # it waited for the commit
    assert list(scored.logprobs) == pytest.approx(await probe(a))
