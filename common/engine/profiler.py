"""Measure this machine: sweep the real engine over batch sizes and fit a `LatencyProfile` to it.

  encode   one iteration encoding n images (n = 1..max_images)
  prefill  one iteration prefilling a T-token prompt (T = 16..max_tokens, doubling)
  decode   one iteration of B running sequences with C context tokens each (B doubling, two C)
  transfer an in-process gather + scatter of KV pages (a lower bound on a pull between workers)
Each point is the median of `repeats` timed iterations after a warm-up; the fits are least squares
of the latency model's own forms (affine in the batch, plus the context terms), clamped at 0.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from common.engine.engine import Engine
from common.latency.model import LatencyProfile, StageCost
from common.request import ImageInput, Request, Stage
from common.sampling import SamplingParams


def _fit(rows: list[list[float]], times: list[float]) -> list[float]:
    """Non-negative least squares for a handful of columns: the best fit over every subset of them."""
    a, y = np.array(rows, dtype=float), np.array(times, dtype=float)
    best, best_err = [0.0] * a.shape[1], float(np.sum(y * y))
    for mask in itertools.product([False, True], repeat=a.shape[1]):
        cols = [i for i, used in enumerate(mask) if used]
        if not cols:
            continue
        coef, *_ = np.linalg.lstsq(a[:, cols], y, rcond=None)
        if np.any(coef < 0):
            continue
        err = float(np.sum((a[:, cols] @ coef - y) ** 2))
        if err < best_err:
            best, best_err = [0.0] * a.shape[1], err
            for i, c in zip(cols, coef):
                best[i] = float(c)
    return best


class Profiler:
    def __init__(self, engine: Engine, repeats: int = 3, progress: Callable[[str], None] | None = None):
        self.engine = engine
        self.repeats = repeats
        self.progress = progress or (lambda _: None)
        self.points: dict[str, list[tuple]] = {"encode": [], "prefill": [], "decode": []}
        self._ids = 0

    def _request(
        self, ids: list[int], images: list[ImageInput], first: Stage, last: Stage, max_tokens: int = 1
    ) -> Request:
        self._ids += 1
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        return Request(f"profile-{self._ids}", ids, sampling, images, first_stage=first, last_stage=last)

    def _time_step(self) -> float:
        start = time.perf_counter()
        self.engine.step()
        return (time.perf_counter() - start) * 1e3

    def _median_first_step(self, add: Callable[[], None]) -> float:
        """Median time of the first step after `add()` queued work, over `repeats` runs after a warm-up."""
        samples = []
        for rep in range(self.repeats + 1):
            add()
            elapsed = self._time_step()
            self._drain()
            if rep:
                samples.append(elapsed)
        return statistics.median(samples)

    def _drain(self) -> None:
        while self.engine.has_unfinished:
            self.engine.step()
        for request_id in list(self.engine.pages.handed_off):
            self.engine.pages.release(request_id)

    def encode(self, counts: list[int]) -> None:
        cfg = self.engine.model_config
        v = cfg.vision
        n_img = cfg.image_tokens_per_image
        pixels = torch.rand(v.num_channels, v.image_size, v.image_size)
        prompt = [1] + [cfg.image_token_id] * n_img + [5, 6]
        for n in counts:

            def add(n=n):
                for _ in range(n):
                    self.engine.add_request(
                        self._request(list(prompt), [ImageInput(pixels, n_img)], Stage.ENCODE, Stage.ENCODE)
                    )

            self.points["encode"].append((n, self._median_first_step(add)))
            self.progress(f"encode {n}")

    def prefill(self, lengths: list[int]) -> None:
        for t in lengths:
            ids = [1] + [7 + i % 1000 for i in range(t - 1)]
            self.points["prefill"].append(
                (
                    t,
                    self._median_first_step(
                        lambda: self.engine.add_request(self._request(list(ids), [], Stage.PREFILL, Stage.PREFILL))
                    ),
                )
            )
            self.progress(f"prefill {t}")

    def decode(self, batches: list[int], contexts: list[int]) -> None:
        for context in contexts:
            for b in batches:
                for _ in range(b):
                    ids = [1] + [9 + i % 1000 for i in range(context - 1)]
                    self.engine.add_request(self._request(ids, [], Stage.PREFILL, Stage.DECODE, self.repeats + 3))
                while len(self.engine.scheduler.running) < b:  # prefill them all
                    self.engine.step()
                self.engine.step()  # warm-up decode
                samples = [self._time_step() for _ in range(self.repeats)]
                self._drain()
                self.points["decode"].append((b, b * (context + 2), statistics.median(samples)))
                self.progress(f"decode {b}x{context}")

    def transfer(self, blocks: int = 64) -> tuple[float, float]:
        """(latency ms, GB/s) of gathering and scattering `blocks` KV blocks in this process."""
        cache = self.engine.kv_cache
        blocks = min(blocks, cache.num_blocks // 2)
        src, dst = list(range(blocks)), list(range(blocks, 2 * blocks))
        times = []
        for _ in range(self.repeats + 1):
            start = time.perf_counter()
            cache.write_raw(dst, cache.gather_bytes(src))
            times.append((time.perf_counter() - start) * 1e3)
        ms = statistics.median(times[1:])
        self.progress("transfer")
        return 0.0, blocks * cache.layout.bytes_per_block / (ms / 1e3) / 1e9

    def profile(self, name: str, hardware: str, model: str, transfer: tuple[float, float]) -> LatencyProfile:
        a_e, b_e = _fit([[1, n] for n, _ in self.points["encode"]], [t for _, t in self.points["encode"]])
        a_p, b_p, c_p = _fit(
            [[1, t, t * t / 2] for t, _ in self.points["prefill"]], [ms for _, ms in self.points["prefill"]]
        )
        a_d, b_d, k_d = _fit(
            [[1, b, ctx] for b, ctx, _ in self.points["decode"]], [ms for *_, ms in self.points["decode"]]
        )
        points = {k: [list(p) for p in v] for k, v in self.points.items()}
        return LatencyProfile(
            name=name,
            source="measured",
            hardware=hardware,
            model=model,
            encode=StageCost(overhead_ms=a_e, per_unit_ms=b_e),
            prefill=StageCost(overhead_ms=a_p, per_unit_ms=b_p, quadratic_ms=c_p),
            decode=StageCost(overhead_ms=a_d, per_unit_ms=b_d, quadratic_ms=k_d),
            transfer_latency_ms=transfer[0],
            transfer_gbps=transfer[1],
            image_tokens=self.engine.model_config.image_tokens_per_image,
            notes=f"measured points (x, ms) / (batch, context tokens, ms): {points}",
        )
