"""``toy``: a deterministic, seeded n-gram language model that is a real engine, not a mock.

The next-token distribution depends on the last two tokens through fixed random tables
(bigram + hashed trigram logits), so it has genuine, context-dependent probabilities and
exact logprobs. It honours every sampling knob (temperature, top-k, top-p, seed, stop ids,
max_tokens, ignore_eos), verifies speculative drafts exactly (``GenerateRequest.drafter``:
one "forward" scores the whole draft, ``engines.sampling.verify`` accepts or resamples) and
has a word-level tokenizer with a small chat template, which
makes it the engine of choice for fast protocol, load, fuzz and distribution tests.

Invariants: the same ``(ToyConfig.seed, token history, SamplingParams.seed)`` always yields
the same tokens; the reported logprob of a sampled token is the exact log-probability of the
distribution it was drawn from (``engines.sampling``).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncGenerator, Collection, Sequence
from dataclasses import dataclass, field

import numpy as np

from core.types import (
    Capability,
    Drafter,
    EngineCounters,
    EngineHealth,
    EngineInfo,
    FinishReason,
    GenerateRequest,
    Message,
    Origin,
    SamplingParams,
    TokenChunk,
    Usage,
    WeightUpdate,
)
from engines.config import ToyConfig
from engines.sampling import kept_logmass, raw_logprob, sample, unfiltered, verify
from engines.scoring import ScoreRequest, ScoreResult

SPECIALS = ("<pad>", "<bos>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<unk>")
PAD, BOS, END, SYSTEM, USER, ASSISTANT, TOOL, UNK = range(len(SPECIALS))
ROLE_TOKENS = {"system": SYSTEM, "user": USER, "assistant": ASSISTANT, "tool": TOOL}
_WORDS = """
the a of to and in is it that for on with as was at by this be from or have an are not but what all
were when we there can which their one said if do will each about how up out them then she many some
so these would other into has more her two like him see time could no make than first been its who
now people my made over did down only way find use may water long little very after words called
just where most know get through back much before go good new write our used me man too any day same
right look think also around another came come work three word must because does part even place
well such here take why things help put years different away again off went old number great tell
men say small every found still between name should home big give air line set own under read last
never us left end along while might next sound below saw something thought both few those always
looked show large often together asked house world going want school important until form food keep
children feet land side without boy once animals life enough took sometimes four head above kind
began almost live page got earth need far hand high year mother light parts country father let night
following picture being study second eyes soon times story boys since white days ever paper hard
near sentence better best across during today others however sure means knew try told young miles
sun ways thing whole hear example heard several change answer room sea against top turned learn
point city play toward five using himself usually zero six seven eight nine ten plus minus equals
tool call result query error done yes
""".split()  # noqa: SIM905 - a word list reads better as text


SEED_CACHE = 4096  # seeds whose SeedSequence is kept (a Generator from one costs a third of default_rng(seed))
TOY_BASE_WEIGHTS = "toy:base"  # the toy's own name for its initial tables (EngineInfo.base_weights)
CAPABILITIES = frozenset(
    {Capability.RAW_LOGPROBS, Capability.KEPT_MASS, Capability.MIN_P, Capability.DRAFT_VERIFY, Capability.GROUP_PREFILL}
)  # GROUP_PREFILL: it has no KV to share, so nothing gains from holding a group's members back


class ToyTokenizer:
    """Word-level tokenizer: specials, then a fixed English word list, then ``w<i>`` fillers."""

    def __init__(self, vocab_size: int) -> None:
        words = list(SPECIALS) + _WORDS
        words += [f"w{i}" for i in range(len(words), vocab_size)]
        self.vocab: list[str] = words[:vocab_size]
        self._ids = {w: i for i, w in enumerate(self.vocab)}

    def encode(self, text: str) -> list[int]:
        return [self._ids.get(w, UNK) for w in text.split()]

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(map(self.vocab.__getitem__, ids))

    def _render(self, messages: Sequence[Message]) -> list[int]:
        out: list[int] = []
        for m in messages:
            out.append(ROLE_TOKENS.get(m.role, USER))
            out.extend(self.encode(m.content))
            out.append(END)
        return out

    def render_prompt(self, messages: Sequence[Message], tool_schemas: Sequence[str] = ()) -> list[int]:
        head = [Message("system", "tools: " + " ".join(tool_schemas))] if tool_schemas else []
        return [BOS, *self._render([*head, *messages]), ASSISTANT]

    def render_continuation(self, messages: Sequence[Message], history: Sequence[int]) -> list[int]:
        close = [] if history and history[-1] == END else [END]
        return [*close, *self._render(messages), ASSISTANT]


@dataclass(slots=True)
class _Run:
    """One request's sampling state between the chunks ``ToyEngine.generate`` emits."""

    history: list[int]  # the tokens so far (without a drafter, only the last two of the prompt and what follows)
    params: SamplingParams
    rng: np.random.Generator
    drafter: Drafter | None
    stops: set[int]
    budget: int
    want_raw: bool
    want_kept: bool
    # Draws may be taken a chunk at a time: the request's own generator (discarded after it), or the shared one
    # when no stop can end the chunk early (every draw taken is then used, so the shared stream is unchanged).
    predraw: bool
    plain: bool  # temperature 1, no filter: sampled from the exp tables (a forward without a draft too)
    produced: int = 0
    saved: int = 0  # tokens emitted beyond one per target forward (speculation)
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    raw: list[float] = field(default_factory=list)
    kept: list[float] = field(default_factory=list)  # log kept mass (sampling.kept_mass)
    origins: list[Origin] = field(default_factory=list)  # left empty by plain sampling: all sampled


class ToyEngine:
    """In-process toy engine (see module docstring)."""

    def __init__(self, config: ToyConfig, model: str = "toy", replica: str = "local") -> None:
        self.config = config
        v = config.vocab_size
        rng = np.random.default_rng(config.seed)
        self._bigram = rng.normal(0.0, 2.0, size=(v, v))
        self._trigram = rng.normal(0.0, 1.0, size=(997, v))
        banned = [PAD, BOS, SYSTEM, USER, ASSISTANT, TOOL, UNK]
        self._bigram[:, banned] = -np.inf
        self._bigram[:, END] += config.end_bias - self._bigram[:, END].mean()
        # exp(bigram + trigram) = exp(bigram) * exp(trigram): plain sampling (temperature 1, no top-k/top-p)
        # needs one product per token instead of add, max, subtract and exp.
        self._set_bigram(self._bigram)
        self._base_bigram = self._bigram
        self._exp_trigram = np.exp(self._trigram)
        self._trigram_rows = list(self._exp_trigram)
        self._rng = np.random.default_rng(config.seed + 1)
        self._seeds: dict[int, np.random.SeedSequence] = {}
        self._last_id = v - 1
        self._aborted: set[str] = set()
        self._version = 0
        self._checkpoint = TOY_BASE_WEIGHTS
        self._previous: tuple[str, int, np.ndarray] = (TOY_BASE_WEIGHTS, 0, self._bigram)  # what it served before
        self.tokenizer = ToyTokenizer(v)
        self.counters = EngineCounters()
        self.info = EngineInfo(
            engine="toy",
            model=model or "toy",
            vocab_size=v,
            max_model_len=config.max_model_len,
            eos_token_ids=(END,),
            replica=replica,
            capabilities=CAPABILITIES
            | ({Capability.WEIGHT_UPDATES} if config.supports_weight_updates else set())
            | ({Capability.SCORE} if config.supports_scoring else set()),
            base_weights=TOY_BASE_WEIGHTS,
        )

    @property
    def policy_version(self) -> int:
        return self._version

    def logits(self, history: Sequence[int]) -> np.ndarray:
        """Next-token logits after ``history`` (the model's exact distribution at temperature 1)."""
        last = history[-1] if history else BOS
        prev = history[-2] if len(history) > 1 else BOS
        return self._bigram[last] + self._trigram[(prev * 31 + last) % 997]

    def _set_bigram(self, bigram: np.ndarray) -> None:
        self._bigram = bigram
        self._exp_bigram = np.exp(bigram)
        self._bigram_rows = list(self._exp_bigram)  # row views: a list index costs a tenth of an array index

    def _generator(self, seed: int | None) -> np.random.Generator:
        """The shared generator, or a fresh one for ``seed``: ``default_rng(seed)``'s stream, built from a kept
        SeedSequence (hashing the seed is most of what ``default_rng`` costs)."""
        if seed is None:
            return self._rng
        seq = self._seeds.get(seed)
        if seq is None:
            if len(self._seeds) >= SEED_CACHE:
                self._seeds.clear()
            seq = self._seeds[seed] = np.random.SeedSequence(seed)
        return np.random.Generator(np.random.PCG64(seq))

    def _sample_plain(self, history: Sequence[int], rng: np.random.Generator) -> tuple[int, float]:
        """``sample(self.logits(history), temperature 1)`` from the exp tables: the same distribution."""
        ids, logprobs, _ = self._sample_run(history, rng, 1, (), False)
        return ids[0], logprobs[0]

    def _sample_run(
        self, history: Sequence[int], rng: np.random.Generator, n: int, stops: Collection[int], predraw: bool
    ) -> tuple[list[int], list[float], bool]:
        """Up to ``n`` tokens sampled plainly after ``history`` (``_sample_plain`` one after another, stopping
        after a token in ``stops``): their ids, logprobs and whether a stop ended them. ``predraw``: the ``n``
        uniform draws are taken in one call (the same stream as ``n`` calls)."""
        rows, trigram, last_id, log = self._bigram_rows, self._trigram_rows, self._last_id, math.log
        last = history[-1] if history else BOS
        prev = history[-2] if len(history) > 1 else BOS
        draws = rng.random(n).tolist() if predraw else None
        ids: list[int] = []
        logprobs: list[float] = []
        # The ufuncs called directly with positional output buffers (cumsum is add.accumulate), searchsorted
        # with a positional side, .item() for Python floats: the same IEEE arithmetic as the array expressions,
        # without their argument parsing, array-function dispatch and allocations, which on a vocabulary this
        # small cost more than the arithmetic.
        multiply, accumulate = np.multiply, np.add.accumulate
        weights, cdf = np.empty(last_id + 1), np.empty(last_id + 1)
        for i in range(n):
            multiply(rows[last], trigram[(prev * 31 + last) % 997], weights)
            accumulate(weights, 0, None, cdf)
            total = cdf.item(-1)
            u = draws[i] if draws is not None else rng.random()
            token = int(cdf.searchsorted(u * total, "right"))
            if token > last_id:  # u * total rounded up to the total
                token = last_id
            while weights.item(token) == 0.0:  # a zero-width bucket can only be hit at its edge
                token -= 1
            ids.append(token)
            logprobs.append(log(weights.item(token) / total))
            if token in stops:
                return ids, logprobs, True
            prev, last = last, token
        return ids, logprobs, False

    def _forward(
        self,
        history: list[int],
        params: SamplingParams,
        rng: np.random.Generator,
        drafter: Drafter | None,
        room: int,
        plain: bool,
    ) -> tuple[list[np.ndarray], list[tuple[int, float, Origin]]]:
        """One target "forward": a verified draft (its logit rows and emitted tokens), or one sampled token."""
        draft = drafter.draft(history, room) if drafter is not None else ()
        if draft:
            assert drafter is not None
            # One target "forward" scores every draft position (plus the bonus position).
            rows = [self.logits([*history, *draft[:i]]) for i in range(len(draft) + 1)]
            emitted = verify(rows, draft, params, rng)
            accepted = sum(o == Origin.DRAFT_ACCEPTED for _, _, o in emitted)
            drafter.feedback(len(draft), accepted)
            extra = self.counters.extra
            extra["spec_drafted"] = extra.get("spec_drafted", 0) + len(draft)
            extra["spec_accepted"] = extra.get("spec_accepted", 0) + accepted
            return rows, emitted
        if plain:
            token, logprob = self._sample_plain(history, rng)
            return [], [(token, logprob, Origin.SAMPLED)]
        logits = self.logits(history)
        token, logprob = sample(logits, params, rng)
        return [logits], [(token, logprob, Origin.SAMPLED)]

    def _plain_chunk(self, run: _Run, every: int) -> bool:
        """Sample plainly up to the next multiple of ``every`` tokens (or the budget); True if a stop ended it."""
        n = min(every - run.produced % every, run.budget - run.produced)
        ids, logprobs, stopped = self._sample_run(run.history, run.rng, n, run.stops, run.predraw)
        run.history += ids
        run.ids += ids
        run.logprobs += logprobs
        if run.want_raw:
            run.raw += logprobs  # plain: raw = sampled
        if run.want_kept:
            run.kept += [0.0] * len(ids)  # plain: nothing cut
        run.produced += len(ids)
        return stopped

    def _forward_chunk(self, run: _Run, every: int) -> bool:
        """Target forwards until one reaches a multiple of ``every`` tokens (or the budget); True if a stop ended
        them. (No await between them: an abort can only arrive between chunks.)"""
        while True:
            rows, emitted = self._forward(
                run.history, run.params, run.rng, run.drafter, run.budget - run.produced - 1, run.plain
            )
            run.saved += len(emitted) - 1
            for i, (token, logprob, origin) in enumerate(emitted):
                if run.want_raw:
                    run.raw.append(raw_logprob(rows[i], token) if rows else logprob)
                if run.want_kept:
                    run.kept.append(kept_logmass(rows[i], run.params) if rows else 0.0)
                run.history.append(token)
                run.ids.append(token)
                run.logprobs.append(logprob)
                run.origins.append(origin)
                run.produced += 1
                if token in run.stops:
                    return True
            if run.produced >= run.budget or run.produced % every < len(emitted):
                return False

    def _take(
        self, run: _Run, version: int, finish: FinishReason | None = None, usage: Usage | None = None
    ) -> TokenChunk:
        """The chunk of the tokens sampled since the previous one (``finish`` and ``usage``: the last chunk's)."""
        chunk = TokenChunk(
            tuple(run.ids),
            tuple(run.logprobs),
            version,
            self._origins(run.origins),
            finish_reason=finish,
            usage=usage,
            raw_logprobs=tuple(run.raw),
            kept_logmass=tuple(run.kept),
        )
        run.ids, run.logprobs, run.raw, run.kept, run.origins = [], [], [], [], []
        return chunk

    async def generate(self, request: GenerateRequest) -> AsyncGenerator[TokenChunk, None]:
        params = request.params
        stops = set(params.stop_token_ids)
        if not params.ignore_eos:
            stops.add(END)
        # The model reads the last two tokens; only a drafter reads the whole history (no copy of it otherwise).
        history = list(request.token_ids if request.drafter is not None else request.token_ids[-2:])
        prompt_len = len(request.token_ids)
        run = _Run(
            history,
            params,
            self._generator(params.seed),
            request.drafter,
            stops,
            budget=min(params.max_tokens, self.config.max_model_len - prompt_len),
            want_raw=params.raw_logprobs,
            want_kept=params.kept_mass,
            predraw=params.seed is not None or not stops,
            plain=params.temperature == 1.0 and unfiltered(params),
        )
        self.counters.requests += 1
        self.counters.prefill_tokens += prompt_len
        version = self._version
        finish = FinishReason.LENGTH
        # Plain sampling without a drafter takes a chunk's tokens in one call; otherwise one target forward at a time.
        fill = self._plain_chunk if run.plain and request.drafter is None else self._forward_chunk
        delay, aborted, request_id = self.config.token_delay_s, self._aborted, request.request_id
        every = 1 if delay else self.config.yield_every  # with a delay, every token is its own chunk
        try:
            while run.produced < run.budget:
                if request_id in aborted:
                    finish = FinishReason.ABORT
                    break
                if delay:
                    await asyncio.sleep(delay)
                if fill(run, every):
                    finish = FinishReason.STOP
                    break
                if run.produced < run.budget:
                    # Emit what we have and let other episodes and cancellation in. Not after
                    # every token: one event-loop turn costs ~100 us inside a grpc.aio server,
                    # more than a toy token, so tokens go out in batches as real engines do.
                    # Not at the budget either: the last chunk below carries those tokens.
                    yield self._take(run, version)
                    if not delay:
                        await asyncio.sleep(0)
            usage = Usage(prompt_tokens=prompt_len, cached_tokens=0, generated_tokens=run.produced)
            yield self._take(run, version, finish, usage)
        finally:
            self.counters.generated_tokens += run.produced
            self.counters.forward_passes += run.produced - run.saved
            self._aborted.discard(request.request_id)

    @staticmethod
    def _origins(origins: list[Origin]) -> tuple[Origin, ...]:
        """Empty (= all sampled, as before speculation existed) unless a token came from a draft."""
        return tuple(origins) if origins.count(Origin.SAMPLED) != len(origins) else ()

    async def abort(self, request_id: str) -> None:
        self._aborted.add(request_id)

    async def health(self) -> EngineHealth:
        return EngineHealth(True)

    async def update_weights(self, update: WeightUpdate) -> None:
        """The toy "weights" are its seed: each load perturbs the current tables by noise drawn from ``(seed,
        version)``, so a second load of one update shows. Loading what it served just before (checkpoint and
        version: a rollback) gives back those tables."""
        served = (self._checkpoint, self._version, self._bigram)
        if (update.checkpoint_path, update.policy_version) == self._previous[:2]:
            self._set_bigram(self._previous[2])
        elif update.checkpoint_path == TOY_BASE_WEIGHTS:  # back to the tables it started with
            self._set_bigram(self._base_bigram)
        else:
            rng = np.random.default_rng([self.config.seed, update.policy_version])
            self._set_bigram(self._bigram + rng.normal(0.0, 0.5, size=self._bigram.shape))
        self._previous = served
        self._checkpoint, self._version = update.checkpoint_path, update.policy_version

    async def score(self, request: ScoreRequest) -> ScoreResult:
        """Teacher-forced logprobs from the tables (``Capability.SCORE`` when ``supports_scoring``)."""
        ids, t = request.token_ids, request.temperature
        out = np.empty(request.scored, dtype=np.float32)
        for k, i in enumerate(range(request.start, len(ids))):
            z = self.logits(ids[:i]) / t
            top = z.max()
            out[k] = z[ids[i]] - top - np.log(np.exp(z - top).sum())
        return ScoreResult(out, self._version)

    async def release(self, episode_id: str) -> None:
        return None

    async def close(self) -> None:
        return None
