"""An online, exponentially weighted, relative-error linear regression (pure Python).

`OnlineRegression` fits `y ≈ θ·x` to a stream of observations so that recent ones
count more (each new observation multiplies the weight of the older ones by
`forgetting`) and relative error is what is minimised (an observation of `y` has
weight `1/y²`, so a 20 ms miss on a 40 ms TTFT counts as much as a 2 s miss on a
4 s one). Cold start and thin data are handled by a ridge prior: θ is pulled
towards `prior` with precision `prior_precision` (per coefficient), so that with no
data the model predicts the prior and a coefficient the data does not excite stays
near it instead of drifting. The prior is worth `prior_weight` observations at
feature values `prior_scale`, measured at the latencies actually observed (the mean
observation weight), so that "worth k observations" holds whether latencies are
10 ms or 10 s. The prior can change between solves (a per-endpoint
model uses the pool-wide model's current θ as its prior: hierarchical shrinkage).

Observations the fit misses badly are down-weighted (Huber on the relative error).
`observe` costs O(d²) for the sufficient statistics, and θ is solved (O(d³), by
Cholesky: the system is symmetric positive definite) only when it is read after a
change; both steps run as generated straight-line code (`unrolled`), a few
microseconds each at d ≤ 9. `predict` is a d-term dot product.
"""

from __future__ import annotations

from collections.abc import Sequence

from servegate.scheduling.latency.unrolled import accumulate, ridge_solver, triangle_index

HUBER_AFTER = 20.0
"""Observations (forgotten) before down-weighting misses: a cold fit must learn from them."""


def solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """`a x = b` by Gaussian elimination with partial pivoting; None when singular.

    `a` and `b` are copied; the inputs are left untouched.
    """
    n = len(b)
    m = [[*row, rhs] for row, rhs in zip(a, b, strict=True)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-18:
            return None
        if pivot != col:
            m[col], m[pivot] = m[pivot], m[col]
        head = m[col]
        inv = 1.0 / head[col]
        for r in range(col + 1, n):
            row = m[r]
            f = row[col] * inv
            if f != 0.0:
                for c in range(col, n + 1):
                    row[c] -= f * head[c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        row = m[r]
        acc = row[n]
        for c in range(r + 1, n):
            acc -= row[c] * x[c]
        x[r] = acc / row[r]
    return x


class OnlineRegression:
    """Weighted ridge regression over exponentially forgotten sufficient statistics.

    θ is solved lazily: `observe` only updates the statistics, and θ is solved when
    read after a change (`theta`), with the prior as it was at the last observation,
    which gives the θ an eager solve after every observation would have given. The
    symmetric statistics are kept as their upper triangle (`unrolled`).
    """

    __slots__ = (
        "_accumulate", "_solve_prior", "_solver", "_stale", "_theta", "_wsum", "_xtx",
        "_xty", "effective_n", "forgetting", "prior", "prior_scale", "prior_weight",
        "typical",
    )  # fmt: skip

    def __init__(
        self,
        prior: Sequence[float],
        prior_scale: Sequence[float],
        prior_weight: float = 1.0,
        forgetting: float = 0.99,
        typical: float = 1.0,
    ) -> None:
        if len(prior) != len(prior_scale):
            raise ValueError("prior and prior_scale must have the same length")
        if not 0.0 < forgetting <= 1.0:
            raise ValueError("forgetting must be in (0, 1]")
        if prior_weight <= 0.0 or typical <= 0.0:
            raise ValueError("prior_weight and typical must be > 0")
        d = len(prior)
        self.prior = list(prior)
        """The coefficients θ is pulled towards; read at each `observe` (and `refit`)."""
        self.prior_scale = [x * x for x in prior_scale]
        self.prior_weight = prior_weight
        self.typical = typical
        """The latency the prior's weight is measured at before any observation."""
        self.forgetting = forgetting
        self._wsum = 0.0
        self._theta = list(prior)
        self._stale = False
        """Whether observations came since θ was last solved."""
        self._solve_prior = self.prior
        self.effective_n = 0.0
        """Sum of the forgotten observation counts: how much data the fit rests on."""
        self._xtx = [0.0] * (d * (d + 1) // 2)
        self._xty = [0.0] * d
        self._accumulate = accumulate(d)
        self._solver = ridge_solver(d)

    @property
    def theta(self) -> list[float]:
        """The fitted coefficients (solved here when observations came since the last solve)."""
        if self._stale:
            self._refit()
        return self._theta

    @theta.setter
    def theta(self, theta: list[float]) -> None:
        """Replace the fit (until the next observation)."""
        self._theta = theta
        self._stale = False

    def predict(self, x: Sequence[float]) -> float:
        theta = self.theta
        total = 0.0
        for i in range(len(theta)):
            total += theta[i] * x[i]
        return total

    def observe(
        self,
        x: Sequence[float],
        y: float,
        floor: float = 1e-9,
        huber: float = 0.5,
        predicted: float | None = None,
    ) -> None:
        """Learn from one observation `y` at features `x` (θ is solved when next read).

        An observation the current fit misses by more than `huber` (relative) counts
        less, in proportion (a Huber loss on the relative error), so one stalled
        request does not drag the fit. `predicted`: `predict(x)`, when the caller has it.
        """
        lam = self.forgetting
        y_floor = max(y, floor)
        w = 1.0 / y_floor**2
        if self.effective_n >= HUBER_AFTER:
            if predicted is None:
                predicted = self.predict(x)
            miss = abs(y - predicted) / y_floor
            if miss > huber:
                w *= huber / miss
        self._xtx, self._xty = self._accumulate(self._xtx, self._xty, x, w, y, lam)
        self.effective_n = lam * self.effective_n + 1.0
        self._wsum = lam * self._wsum + w
        self._solve_prior = self.prior
        self._stale = True

    def refit(self, prior: Sequence[float] | None = None) -> None:
        """Solve θ now, optionally towards a new `prior` (kept for later solves)."""
        if prior is not None:
            self.prior = list(prior)
        self._solve_prior = self.prior
        self._refit()

    def _refit(self) -> None:
        self._stale = False
        n = self.effective_n
        mean_w = self._wsum / n if n > 0.0 else 1.0 / self.typical**2
        k = self.prior_weight * mean_w
        prior = self._solve_prior
        theta = self._solver(self._xtx, self._xty, k, self.prior_scale, prior)
        if theta is None:  # rounding broke positive definiteness: pivoted elimination
            theta = solve(*self._system(k, prior))
        if theta is not None:
            self._theta = theta

    def _system(self, k: float, prior: Sequence[float]) -> tuple[list[list[float]], list[float]]:
        """The full ridge system `(A, b)` (for the pivoted fallback)."""
        d = len(self._xty)
        scale = self.prior_scale
        tri = self._xtx
        a = [[tri[triangle_index(d, min(i, j), max(i, j))] for j in range(d)] for i in range(d)]
        b = list(self._xty)
        for i in range(d):
            p = k * scale[i]
            a[i][i] += p
            b[i] += p * prior[i]
        return a, b
