"""Fit LLMServeEnv's second cost-coefficient set from measurements of this project's embedded engine.

The simulator prices engine steps in DistServe's form (``llmserve/profiles.py``): a prefill of prompt
length ``n`` costs ``a + b*n + c*n^2`` ms, a decode iteration over ``B`` sequences of context ``ctx`` costs
``a + b*B*ctx + c*B + d*[B > 1]`` ms (``d``: the CPU's GEMM-instead-of-GEMV step, see ``profiles``). This
script measures exactly the forward passes the embedded engine runs (``engines/embedded/scheduler.py``: one prefill
forward per sequence; one batched decode forward over the left-packed caches, ``engines.embedded.kvcache.pack_left``)
for SmolLM2-135M on torch CPU over a grid of shapes, keeps the minimum of ``--repeats`` timings per shape,
taken round-robin over the shapes (the least disturbed by other load), fits the coefficients by non-negative
least squares (``scipy.optimize.nnls``) on the training shapes, and checks the fit on held-out shapes (every
third shape of each grid, never used in the fit): target max relative error <= 20 %.

Writes ``llmserve/data/coeffs_embedded_smollm2_cpu.json`` (read by ``profiles.EMBEDDED_SMOLLM2_CPU``)
and records the table in ``bench/RESULTS.md``.

Usage: python bench/llmserve_fit.py [--repeats 5] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import machine, record
from engines.config import EmbeddedConfig
from engines.embedded.kvcache import forward_with_cache, new_cache, pack_left
from engines.embedded.model import load_model
from llmserve.profiles import COEFFS_FILE

PREFILL_SHAPES = tuple((n,) for n in (16, 32, 48, 64, 96, 128, 192, 256, 320, 384, 448, 512))
DECODE_SHAPES = tuple((b, ctx) for b in (1, 2, 4, 8) for ctx in (32, 64, 128, 256, 384, 512))
TARGET_ERROR = 0.20


def min_ms(steps: dict[Any, Callable[[], Any]], repeats: int, desc: str) -> dict[Any, float]:
    """The minimum time of each step over ``repeats`` rounds; a round runs every shape once (round-robin), so a
    burst of load elsewhere on the machine spoils one timing of many shapes rather than every timing of one."""
    from tqdm import tqdm

    best = dict.fromkeys(steps, float("inf"))
    for _ in tqdm(range(repeats), desc=desc):
        for shape, step in steps.items():
            t0 = time.perf_counter()
            step()
            best[shape] = min(best[shape], (time.perf_counter() - t0) * 1000)
    return best


def prefill_step(model: Any, n: int) -> Callable[[], None]:
    import torch

    ids = torch.arange(100, 100 + n).unsqueeze(0)

    def once() -> None:
        forward_with_cache(model, new_cache(model.config), input_ids=ids, use_cache=True, logits_to_keep=1)

    return once


def decode_step(model: Any, batch: int, ctx: int) -> Callable[[], None]:
    import torch

    caches = []
    for i in range(batch):  # each sequence's KV, built as the engine builds it (not timed)
        cache = new_cache(model.config)
        forward_with_cache(model, cache, input_ids=torch.arange(200 + i, 200 + i + ctx).unsqueeze(0), use_cache=True)
        caches.append(cache)
    cache, mask = (caches[0], None) if batch == 1 else pack_left(caches, [ctx] * batch)
    pos = ctx

    def once() -> None:
        nonlocal mask, pos
        kwargs: dict[str, Any] = {"input_ids": torch.full((batch, 1), 42), "use_cache": True}
        if mask is not None:  # the engine's batched decode: grown mask and explicit positions
            mask = torch.cat([mask, torch.ones(batch, 1, dtype=mask.dtype)], dim=1)
            kwargs |= {"attention_mask": mask, "position_ids": torch.full((batch, 1), pos)}
        forward_with_cache(model, cache, **kwargs)
        pos += 1

    return once


def _fit(rows: np.ndarray, times: np.ndarray) -> np.ndarray:
    from scipy.optimize import nnls

    # Relative least squares: each shape weighs by 1/time, so short steps are fitted as well as long ones.
    w = 1.0 / times
    coef, _ = nnls(rows * w[:, None], times * w)
    return np.asarray(coef)


def prefill_row(n: int) -> list[float]:
    return [1.0, float(n), float(n * n)]


def decode_row(batch: int, ctx: int) -> list[float]:
    return [1.0, float(batch * ctx), float(batch), float(batch > 1)]


def split(items: tuple[Any, ...]) -> tuple[list[Any], list[Any]]:
    """Every third item is held out (never fitted), the rest train."""
    return [x for i, x in enumerate(items) if i % 3 != 1], [x for i, x in enumerate(items) if i % 3 == 1]


def evaluate(
    kind: str,
    shapes: tuple[tuple[int, ...], ...],
    measured: dict[tuple[int, ...], float],
    row: Callable[..., list[float]],
) -> tuple[np.ndarray, list[dict[str, Any]]]:
    train, held = split(shapes)
    coef = _fit(np.array([row(*s) for s in train]), np.array([measured[s] for s in train]))
    out = []
    for s in held:
        pred = float(np.dot(coef, row(*s)))
        out.append({"kind": kind, "shape": s, "measured_ms": measured[s], "predicted_ms": pred,
                    "rel_error": abs(pred - measured[s]) / measured[s]})  # fmt: skip
    return coef, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="timings per shape; the minimum is kept")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: the engine's default)")
    args = parser.parse_args()
    import torch

    config = EmbeddedConfig(num_threads=args.threads) if args.threads else EmbeddedConfig()
    model = load_model(config, "").model
    with torch.inference_mode():
        prefill_step(model, 64)()  # warm-up (allocator, kernels)
        prefill = min_ms({s: prefill_step(model, *s) for s in PREFILL_SHAPES}, args.repeats, "prefill rounds")
        decode = min_ms({s: decode_step(model, *s) for s in DECODE_SHAPES}, args.repeats, "decode rounds")
    pc, p_held = evaluate("prefill", PREFILL_SHAPES, prefill, prefill_row)
    dc, d_held = evaluate("decode", DECODE_SHAPES, decode, decode_row)
    held = p_held + d_held
    worst = max(h["rel_error"] for h in held)
    coeffs = {
        "name": "embedded-smollm2-135m-cpu",
        "source": f"bench/llmserve_fit.py: SmolLM2-135M on torch CPU, embedded engine's forwards, {machine()}",
        "prefill_a": pc[0], "prefill_b": pc[1], "prefill_c": pc[2],
        "decode_a": dc[0], "decode_b": dc[1], "decode_c": dc[2], "decode_multi": dc[3],
        "fit": {"held_out_max_rel_error": worst, "repeats": args.repeats, "machine": machine(),
                "date": time.strftime("%Y-%m-%d %H:%M"), "prefill_ms": {str(n): v for (n,), v in prefill.items()},
                "decode_ms": {f"{b}x{c}": v for (b, c), v in decode.items()}},
    }  # fmt: skip
    COEFFS_FILE.write_text(json.dumps(coeffs, indent=2) + "\n")
    rows = [
        ("prefill ms = a + b*n + c*n^2", f"a={pc[0]:.3f} b={pc[1]:.5f} c={pc[2]:.3e}", "fitted (NNLS)"),
        (
            "decode ms = a + b*B*ctx + c*B + d*[B>1]",
            f"a={dc[0]:.3f} b={dc[1]:.3e} c={dc[2]:.4f} d={dc[3]:.3f}",
            "fitted (NNLS)",
        ),
    ]
    rows += [
        (f"held-out {h['kind']} {h['shape']}", f"{h['predicted_ms']:.2f} vs {h['measured_ms']:.2f} ms "
         f"({h['rel_error'] * 100:.1f} %)", "<= 20 %")
        for h in held
    ]  # fmt: skip
    verdict = "MET" if worst <= TARGET_ERROR else "MISSED"
    rows.append(("max held-out relative error", f"{worst * 100:.1f} %", f"<= 20 % {verdict}"))
    notes = (
        f"{len(PREFILL_SHAPES)} prefill lengths and {len(DECODE_SHAPES)} decode (batch, context) shapes, minimum of "
        f"{args.repeats} round-robin timings each; every third shape held out of the fit. Coefficients written to "
        f"{COEFFS_FILE.relative_to(Path(__file__).resolve().parents[1])}."
    )
    record("llmserve_fit", "LLMServeEnv cost coefficients fitted to the embedded engine", rows,
           {"coefficients": coeffs, "held_out": [{**h, "shape": list(h["shape"])} for h in held]},
           notes=notes)  # fmt: skip


if __name__ == "__main__":
    main()
