"""Verdict formats: canonical trajectory encoding, in-toto Statement, DSSE PAE/envelopes, C2SP checkpoints, keys."""

from __future__ import annotations

import base64
import hashlib
import json
import math
import struct
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from pydantic import ValidationError

from core.canonical import canonical_json
from core.errors import InvalidArgument
from envhub.graders import get_grader
from sandbox.policies import load_policy
from verifier.keys import KeyRing, PublicKey, note_key_hash
from verifier.service import ScoreRequest
from verifier.signing import (
    PAYLOAD_TYPE,
    Checkpoint,
    SignatureError,
    open_checkpoint,
    open_envelope,
    pae,
    sign_envelope,
)
from verifier.statement import Trajectory, VerdictSample

TRAJ: dict[str, Any] = {
    "episode_id": "ep",
    "token_ids": [5, 6],
    "logprobs": [None, -0.5],
    "loss_mask": [0, 1],
    "origins": ["prompt", "sampled"],
    "policy_versions": [0, 3],
}


def test_pae_matches_the_dsse_spec_example() -> None:
    assert pae("http://example.com/HelloWorld", b"hello world") == (
        b"DSSEv1 29 http://example.com/HelloWorld 11 hello world"
    )


def test_canonical_encoding_is_exactly_the_documented_layout() -> None:
    t = Trajectory.model_validate(TRAJ)
    expected = (
        b"primerl.trajectory.v1\n"
        + struct.pack(">I", 2)
        + b"ep"
        + struct.pack(">I", 2)
        + struct.pack(">2q", 5, 6)
        + bytes.fromhex("7ff8000000000000")
        + struct.pack(">d", -0.5)
        + bytes([0, 1])
        + bytes([1, 3])
        + struct.pack(">2q", 0, 3)
    )
    assert t.encode() == expected
    assert t.digest() == hashlib.sha256(expected).hexdigest()
    # every spelling of the same trajectory has the same subject; any change of a value changes it
    same = {**TRAJ, "logprobs": [math.nan, -0.5], "origins": [1, 3], "loss_mask": [False, True]}
    assert Trajectory.model_validate(same).digest() == t.digest()
    payload_nan = struct.unpack(">d", bytes.fromhex("fff8000000000001"))[0]  # a negative NaN with a payload
    assert Trajectory.model_validate({**TRAJ, "logprobs": [payload_nan, -0.5]}).digest() == t.digest()
    for field, value in [("token_ids", [5, 7]), ("logprobs", [None, -0.25]), ("loss_mask", [1, 1]),
                         ("origins", [1, 2]), ("policy_versions", [0, 4]), ("episode_id", "ep2")]:  # fmt: skip
        assert Trajectory.model_validate({**TRAJ, field: value}).digest() != t.digest(), field


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"loss_mask": [0, 2]}, "loss_mask"),
        ({"origins": ["prompt", "oracle"]}, "origins"),
        ({"origins": [1, 9]}, "origins"),
        ({"policy_versions": [0]}, "policy_versions has 1 entries"),
        ({"episode_id": ""}, "episode_id"),
        ({"token_ids": [1, "x"]}, "token_ids"),
    ],
)
def test_malformed_trajectories_name_the_field(patch: dict[str, Any], field: str) -> None:
    with pytest.raises(ValidationError, match=field):
        Trajectory.model_validate({**TRAJ, **patch})


def test_envelope_signs_the_statement_and_detects_every_change(tmp_path: Path) -> None:
    ring = KeyRing.open(tmp_path)
    keys = {ring.active.public.keyid: ring.active.public}
    env = sign_envelope({"_type": "x", "n": 1}, ring.active)
    assert env["payloadType"] == PAYLOAD_TYPE
    sig = base64.b64decode(env["signatures"][0]["sig"])
    body = base64.b64decode(env["payload"])
    Ed25519PublicKey.from_public_bytes(ring.active.public.public_key).verify(sig, pae(PAYLOAD_TYPE, body))
    assert open_envelope(env, keys) == {"_type": "x", "n": 1}
    forged = [
        {**env, "payload": base64.b64encode(b'{"_type":"x","n":2}').decode()},
        {**env, "payloadType": "text/plain"},
        {**env, "signatures": [{"keyid": "0" * 16, "sig": env["signatures"][0]["sig"]}]},
        {**env, "signatures": []},
        {k: v for k, v in env.items() if k != "signatures"},
    ]
    for bad in forged:
        with pytest.raises(SignatureError):
            open_envelope(bad, keys)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nan_and_infinity_are_refused_on_every_path_that_signs(tmp_path: Path, bad: float) -> None:
    ring = KeyRing.open(tmp_path)
    with pytest.raises(ValueError, match="JSON compliant"):  # a Statement (and so the envelope, the log's leaf)
        sign_envelope({"_type": "x", "predicate": {"reward": bad}}, ring.active)
    with pytest.raises(ValidationError, match="NaN or Infinity"):  # a grader's params, signed with the verdict
        ScoreRequest.model_validate({"grader": "constant", "trajectory": TRAJ, "params": {"value": bad}})
    # The sandbox policy digest a verdict signs: a policy holding a non-number (model_copy skips validation).
    policy = load_policy("grader")
    broken = policy.model_copy(update={"limits": policy.limits.model_copy(update={"wall_s": bad})})
    with pytest.raises(ValueError, match="JSON compliant"):
        broken.digest()
    assert policy.digest() == "sha256:" + hashlib.sha256(canonical_json(policy.model_dump(mode="json"))).hexdigest()


def test_checkpoint_is_a_c2sp_signed_note(tmp_path: Path) -> None:
    ring = KeyRing.open(tmp_path)
    pub = ring.active.public
    root = hashlib.sha256(b"root").digest()
    note = Checkpoint("example.com/log", 42, root).sign(ring.active)
    text, sig_line = note.split("\n\n")
    assert text == f"example.com/log\n42\n{base64.b64encode(root).decode()}"
    assert sig_line.startswith("\u2014 example.com/log ") and sig_line.endswith("\n")
    raw = base64.b64decode(sig_line.split(" ")[2])
    assert (
        raw[:4]
        == hashlib.sha256(b"example.com/log\n\x01" + pub.public_key).digest()[:4]
        == note_key_hash("example.com/log", pub.public_key)
    )
    Ed25519PublicKey.from_public_bytes(pub.public_key).verify(raw[4:], (text + "\n").encode())
    assert open_checkpoint(note, [pub]) == Checkpoint("example.com/log", 42, root)
    # an unknown extra signer is ignored; a changed body, origin or signature is not
    other = KeyRing.open(tmp_path / "other").active
    cosigned = note + Checkpoint("example.com/log", 42, root).sign(other).split("\n\n")[1]
    assert open_checkpoint(cosigned, [pub]).tree_size == 42
    for bad in (note.replace("\n42\n", "\n43\n"), note.replace(sig_line[-10:-1], "A" * 9)):
        with pytest.raises(SignatureError):
            open_checkpoint(bad, [pub])
    with pytest.raises(SignatureError, match="origin"):
        open_checkpoint(note, [pub], origin="other/log")
    with pytest.raises(SignatureError, match="not signed by a known key"):
        open_checkpoint(note, [other.public])


def test_key_directory_reopens_and_rotates(tmp_path: Path) -> None:
    first = KeyRing.open(tmp_path).active.public
    assert oct((tmp_path / f"{first.keyid}.pem").stat().st_mode & 0o777) == "0o600"
    assert KeyRing.open(tmp_path).active.public == first
    ring = KeyRing.open(tmp_path)
    second = ring.rotate().public
    reopened = KeyRing.open(tmp_path)
    assert reopened.active.public.keyid == second.keyid and set(reopened.keys) == {first.keyid, second.keyid}
    listed = PublicKey.from_json(json.loads(json.dumps(first.to_json("o", False))))
    assert listed.public_key == first.public_key and listed.keyid == first.keyid
    assert first.vkey("o").startswith(f"o+{note_key_hash('o', first.public_key).hex()}+")


def test_constant_grader_returns_params_value() -> None:
    grader = get_grader("constant")
    sample = VerdictSample(Trajectory.model_validate(TRAJ), {"value": 0.25})
    assert grader(sample) == 0.25
    for bad in ({}, {"value": "1"}, {"value": True}):
        with pytest.raises(InvalidArgument, match=r"params\.value"):
            grader(VerdictSample(Trajectory.model_validate(TRAJ), bad))
    exact = get_grader("exact")
    assert exact(VerdictSample(Trajectory.model_validate(TRAJ), {"answer": "4", "reference": "4"})) == 1.0


def test_graders_declared_by_entry_point_are_registered(monkeypatch: pytest.MonkeyPatch) -> None:
    from envhub.graders import FnGrader, grader_names
    from verifier import service

    class EntryPoint:
        def load(self) -> Any:
            return FnGrader("ep-length", lambda s: float(len(s.trajectory.token_ids)))

    monkeypatch.setattr(service, "entry_points", lambda group: [EntryPoint()] if group == "primerl.graders" else [])
    assert service.load_entry_point_graders() == ["ep-length"]
    assert "ep-length" in grader_names() and service.load_entry_point_graders() == []  # once
    assert get_grader("ep-length")(VerdictSample(Trajectory.model_validate(TRAJ), {})) == 2.0
