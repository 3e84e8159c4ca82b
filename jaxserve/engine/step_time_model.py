"""Step time as a function of what a step computes, fitted online from the engine's own steps.

Data flow: the scheduler describes a step it plans (`StepFeatures`: its padded token bucket,
its padded sampler rows, the attention keys its queries read) -> `StepTimeModel.predict`
(seconds) -> the SLO policy picks the largest token budget whose predicted step meets the ITL
target (`slo_policy.py`). After the step ran, `StepCore.apply` hands the measured seconds
(ready minus the later of the previous step's ready and this step's start: the gap its streams
saw) to `observe`, which refits.

Model: t = c0 + c1 * T + c2 * S + c3 * K, with T the token bucket (every matmul runs over
the padded tokens), S the sampler rows bucket (logits and sampling over the vocabulary per
row; speculative proposals are rows too) and K the attention key reads (a query at position p
reads p + 1 keys: decodes scale with their context, a prefill chunk with its start and
square). Each term is a cost that grows with its input, so the coefficients are kept >= 0 (a
negative one fitted from noise would promise that more work is faster, and the policy would
take it).

Fit: exponentially weighted least squares (each new step counts 1, one `half_life` steps
ago 1/2: the machine's speed drifts, and other tenants come and go), ridge-regularised toward a
prior (the start-up calibration's fit, `seed`, or none), solved again per observation (a 4 x 4
system). The model also tracks its relative error (EWMA of the squared relative residual
before each update): the policy keeps a margin of that many standard deviations.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterable

import numpy as np

# Features are scaled to O(1) for typical steps so the normal equations are well conditioned:
# T / 256 tokens, S / 32 rows, K / 65,536 key reads.
_SCALE = np.array([1.0, 1 / 256, 1 / 32, 1 / 65536])
_NUM_FEATURES = 4


@dataclasses.dataclass(frozen=True)
class StepFeatures:
    """What one step computes, as the model sees it."""

    tokens: int  # T: the step's token bucket (padded)
    rows: int  # S: its sampler rows bucket (padded)
    attention_keys: int  # K: sum over its queries of the keys each reads

    def vector(self) -> np.ndarray:
        return np.array([1.0, self.tokens, self.rows, self.attention_keys]) * _SCALE


def attention_keys(chunks: Iterable[tuple[int, int]]) -> int:
    """Key reads of queries at positions [start, start + n) for each (start, n): a query at
    position p reads p + 1 keys (the sequence so far, itself included)."""
    return sum(n * start + n * (n + 1) // 2 for start, n in chunks)


class StepTimeModel:
    def __init__(self, half_life: float = 64.0, prior_weight: float = 1e-3):
        """`half_life`: steps after which an observation weighs half; `prior_weight`: how
        many observations' worth the prior (ridge) term counts."""
        if not half_life > 0 or not prior_weight > 0:
            raise ValueError(f"half_life={half_life} and prior_weight={prior_weight} must be > 0")
        self._decay = 0.5 ** (1.0 / half_life)
        self._prior_weight = prior_weight
        self._a = np.zeros((_NUM_FEATURES, _NUM_FEATURES))  # sum of w x x^T
        self._b = np.zeros(_NUM_FEATURES)  # sum of w x y
        self._prior = np.zeros(_NUM_FEATURES)  # coefficients (scaled) the ridge pulls toward
        self._coef = np.zeros(_NUM_FEATURES)
        self._rel_var = 0.0  # EWMA of the squared relative residual
        self.num_observations = 0
        self.last_predicted = 0.0  # seconds: the prediction for the last observed step
        self.last_measured = 0.0

    @property
    def fitted(self) -> bool:
        """Whether the model has anything to go on (observations or a seed)."""
        return self.num_observations > 0 or bool(self._prior.any())

    @property
    def coefficients(self) -> tuple[float, float, float, float]:
        """(seconds, per token, per row, per key read), unscaled."""
        return tuple(float(c) for c in self._coef * _SCALE)  # type: ignore[return-value]

    @property
    def relative_error(self) -> float:
        """The standard deviation of (measured - predicted) / predicted, recently."""
        return math.sqrt(self._rel_var)

    def predict(self, f: StepFeatures) -> float:
        return max(0.0, float(self._coef @ f.vector()))

    def seed(self, samples: Iterable[tuple[StepFeatures, float]]) -> None:
        """Start from a fit of these (features, seconds) (a start-up calibration): it is the
        prior the ridge term pulls toward and counts as `prior_weight` observations."""
        samples = list(samples)
        if not samples:
            return
        a = sum(np.outer(f.vector(), f.vector()) for f, _ in samples)
        b = sum(f.vector() * y for f, y in samples)
        self._prior = _nonnegative_solve(a + 1e-6 * np.eye(_NUM_FEATURES), b)
        self._coef = self._prior.copy()

    def observe(self, f: StepFeatures, seconds: float) -> None:
        """One measured step; refits."""
        if not (math.isfinite(seconds) and seconds >= 0):
            return
        predicted = self.predict(f)
        if self.fitted and predicted > 0:
            rel = (seconds - predicted) / predicted
            self._rel_var = 0.9 * self._rel_var + 0.1 * min(rel * rel, 4.0)
        self.last_predicted, self.last_measured = predicted, seconds
        x = f.vector()
        self._a = self._decay * self._a + np.outer(x, x)
        self._b = self._decay * self._b + x * seconds
        self.num_observations += 1
        ridge = self._prior_weight * np.eye(_NUM_FEATURES)
        self._coef = _nonnegative_solve(self._a + ridge, self._b + ridge @ self._prior)


def _nonnegative_solve(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin of the quadratic form with every coefficient but the intercept >= 0: solve,
    then pin the negative ones to 0 and solve for the rest, until none is negative (at most
    one round per coefficient; the active set of a 4-term model)."""
    free = np.ones(len(b), bool)
    coef = np.zeros(len(b))
    for _ in range(len(b)):
        idx = np.flatnonzero(free)
        coef = np.zeros(len(b))
        coef[idx] = np.linalg.lstsq(a[np.ix_(idx, idx)], b[idx], rcond=None)[0]
        negative = [i for i in idx[1:] if coef[i] < 0] if idx[0] == 0 else \
            [i for i in idx if coef[i] < 0]
        if not negative:
            break
        free[min(negative, key=lambda i: coef[i])] = False
    return coef
