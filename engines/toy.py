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
from collections.abc import AsyncGenerator, Sequence

import numpy as np

from engines.config import ToyConfig
from engines.sampling import raw_logprob, sample, unfiltered, verify
from engines.types import (
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


TOY_BASE_WEIGHTS = "toy:base"  # the toy's own name for its initial tables (EngineInfo.base_weights)
CAPABILITIES = frozenset({Capability.RAW_LOGPROBS, Capability.MIN_P, Capability.DRAFT_VERIFY})


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
        self._exp_bigram = np.exp(self._bigram)
        self._base_bigram = self._bigram
        self._exp_trigram = np.exp(self._trigram)
        self._rng = np.random.default_rng(config.seed + 1)
        self._last_id = v - 1
        self._aborted: set[str] = set()
        self._version = 0
        self.tokenizer = ToyTokenizer(v)
        self.counters = EngineCounters()
        self.info = EngineInfo(
            engine="toy",
            model=model or "toy",
            vocab_size=v,
            max_model_len=config.max_model_len,
            eos_token_ids=(END,),
            replica=replica,
            capabilities=CAPABILITIES | ({Capability.WEIGHT_UPDATES} if config.supports_weight_updates else set()),
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

    def _sample_plain(self, history: Sequence[int], rng: np.random.Generator) -> tuple[int, float]:
        """``sample(self.logits(history), temperature 1)`` from the exp tables: the same distribution."""
        last = history[-1] if history else BOS
        prev = history[-2] if len(history) > 1 else BOS
        weights = self._exp_bigram[last] * self._exp_trigram[(prev * 31 + last) % 997]
        # ndarray methods, not np.cumsum/np.searchsorted: the same computation without the array-function
        # dispatch, which costs more than the arithmetic on a vocabulary this small; and .item(): Python
        # floats, the same IEEE doubles as NumPy scalars, cheaper to compute with.
        cdf = weights.cumsum()
        total = cdf.item(-1)
        token = min(int(cdf.searchsorted(rng.random() * total, side="right")), self._last_id)
        while weights.item(token) == 0.0:  # a zero-width bucket can only be hit at its edge
            token -= 1
        return token, math.log(weights.item(token) / total)

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

    async def generate(self, request: GenerateRequest) -> AsyncGenerator[TokenChunk, None]:
        params = request.params
        rng = np.random.default_rng(params.seed) if params.seed is not None else self._rng
        stops = set(params.stop_token_ids)
        if not params.ignore_eos:
            stops.add(END)
        history = list(request.token_ids)
        prompt_len = len(history)
        budget = min(params.max_tokens, self.config.max_model_len - prompt_len)
        self.counters.requests += 1
        self.counters.prefill_tokens += prompt_len
        version = self._version
        finish = FinishReason.LENGTH
        produced = 0
        ids: list[int] = []
        logprobs: list[float] = []
        raw: list[float] = []
        origins: list[Origin] = []
        drafter = request.drafter
        plain = params.temperature == 1.0 and unfiltered(params)
        saved = 0  # tokens emitted beyond one per target forward (speculation)
        delay, every, want_raw = self.config.token_delay_s, self.config.yield_every, params.raw_logprobs
        aborted, forward, request_id = self._aborted, self._forward, request.request_id
        try:
            while produced < budget:
                if request_id in aborted:
                    finish = FinishReason.ABORT
                    break
                if delay:
                    await asyncio.sleep(delay)
                rows, emitted = forward(history, params, rng, drafter, budget - produced - 1, plain)
                saved += len(emitted) - 1
                stopped = False
                for i, (token, logprob, origin) in enumerate(emitted):
                    if want_raw:
                        raw.append(raw_logprob(rows[i], token) if rows else logprob)  # plain: raw = sampled
                    history.append(token)
                    ids.append(token)
                    logprobs.append(logprob)
                    origins.append(origin)
                    produced += 1
                    if token in stops:
                        stopped = True
                        break
                if stopped:
                    finish = FinishReason.STOP
                    break
                if produced < budget and (delay or produced % every < len(emitted)):
                    # Emit what we have and let other episodes and cancellation in. Not after
                    # every token: one event-loop turn costs ~100 us inside a grpc.aio server,
                    # more than a toy token, so tokens go out in batches as real engines do.
                    # Not at the budget either: the last chunk below carries those tokens.
                    yield TokenChunk(
                        tuple(ids), tuple(logprobs), version, self._origins(origins), raw_logprobs=tuple(raw)
                    )
                    ids, logprobs, raw, origins = [], [], [], []
                    if not delay:
                        await asyncio.sleep(0)
            usage = Usage(prompt_tokens=prompt_len, cached_tokens=0, generated_tokens=produced)
            yield TokenChunk(
                tuple(ids),
                tuple(logprobs),
                version,
                self._origins(origins),
                finish_reason=finish,
                usage=usage,
                raw_logprobs=tuple(raw),
            )
        finally:
            self.counters.generated_tokens += produced
            self.counters.forward_passes += produced - saved
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
        """The toy "weights" are its seed: a new version perturbs the tables deterministically."""
        if update.checkpoint_path == TOY_BASE_WEIGHTS:  # back to the tables it started with
            self._bigram = self._base_bigram
        else:
            rng = np.random.default_rng([self.config.seed, update.policy_version])
            self._bigram = self._bigram + rng.normal(0.0, 0.5, size=self._bigram.shape)
        self._exp_bigram = np.exp(self._bigram)
        self._version = update.policy_version

    async def release(self, episode_id: str) -> None:
        return None

    async def close(self) -> None:
        return None
