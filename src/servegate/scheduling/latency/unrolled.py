"""Straight-line code for `OnlineRegression`'s two per-observation steps, built per dimension.

The latency models have 9 (TTFT) and 6 (TPOT) coefficients and learn on every stream,
in pure Python: a loop nest pays an interpreter round trip per multiply-add, which is
most of the cost at this size. The same arithmetic written out as one expression per
entry, over local variables, runs about six times faster, so each function below is
generated once per dimension (the way `dataclasses` generates `__init__`) and cached.

The symmetric matrix is stored as its upper triangle, row by row (`triangle_index`).

- `accumulate(d)(a, b, x, w, y, lam)`: the forgotten, weighted sufficient statistics
  after one more observation, `(lam·a + w·x xᵀ, lam·b + w·y·x)`, as new lists. Each
  entry is computed with the same operations, in the same order, as the loop nest it
  replaces (`lam·a_ij + (w·x_i)·x_j`), so the statistics are bit-identical to it.
- `ridge_solver(d)(a, b, k, scale, prior)`: θ solving `(A + k·diag(scale)) θ = b +
  k·diag(scale)·prior` by Cholesky (the matrix is symmetric positive definite: a sum of
  weighted outer products plus a positive diagonal), or None when rounding made it
  not positive definite (the caller then falls back to pivoted elimination). Half the
  work of Gaussian elimination, no row copies and no pivot search; it agrees with
  elimination to rounding (1e-13 relative on the recorded traces; see
  docs/latency-routing.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import cache

Accumulate = Callable[
    [Sequence[float], Sequence[float], Sequence[float], float, float, float],
    tuple[list[float], list[float]],
]
RidgeSolver = Callable[
    [Sequence[float], Sequence[float], float, Sequence[float], Sequence[float]],
    list[float] | None,
]


def triangle_index(d: int, i: int, j: int) -> int:
    """Position of entry (i, j), i ≤ j, of a d×d symmetric matrix stored as its upper
    triangle row by row."""
    return i * d - i * (i - 1) // 2 + (j - i)


def _compile(source: str, name: str) -> object:
    namespace: dict[str, object] = {"sqrt": math.sqrt}
    exec(compile(source, f"<unrolled {name}>", "exec"), namespace)
    return namespace[name]


def _names(prefix: str, d: int) -> str:
    return ", ".join(f"{prefix}{i}" for i in range(d))


def _triangle(prefix: str, d: int) -> str:
    return ", ".join(f"{prefix}{i}_{j}" for i in range(d) for j in range(i, d))


@cache
def accumulate(d: int) -> Accumulate:
    """The statistics update for dimension `d` (see the module docstring)."""
    lines = [
        "def accumulate(a, b, x, w, y, lam):",
        f"    {_names('x', d)}, = x",
        f"    {_triangle('a', d)}, = a",
        f"    {_names('b', d)}, = b",
        *(f"    w{i} = w * x{i}" for i in range(d)),
        "    return [" + ", ".join(
            f"lam * a{i}_{j} + w{i} * x{j}" for i in range(d) for j in range(i, d)
        ) + "], [" + ", ".join(f"lam * b{i} + w{i} * y" for i in range(d)) + "]",
    ]  # fmt: skip
    fn = _compile("\n".join(lines), "accumulate")
    return fn  # type: ignore[return-value]


@cache
def ridge_solver(d: int) -> RidgeSolver:
    """The ridge-regularised Cholesky solve for dimension `d` (see the module docstring).

    A = Uᵀ U with U upper triangular, row i of U from the rows above it; then Uᵀ z = b
    forwards (interleaved with the factorisation) and U θ = z backwards.
    """
    lines = [
        "def ridge_solver(a, b, k, scale, prior):",
        f"    {_triangle('a', d)}, = a",
        f"    {_names('b', d)}, = b",
        f"    {_names('s', d)}, = scale",
        f"    {_names('m', d)}, = prior",
    ]
    for i in range(d):
        lines.append(f"    p = k * s{i}")
        diagonal = f"a{i}_{i} + p" + "".join(f" - u{r}_{i} * u{r}_{i}" for r in range(i))
        lines += [
            f"    t = {diagonal}",
            "    if not t > 0.0:",
            "        return None",
            f"    u{i}_{i} = sqrt(t)",
            f"    r{i} = 1.0 / u{i}_{i}",
        ]
        for j in range(i + 1, d):
            above = "".join(f" - u{r}_{i} * u{r}_{j}" for r in range(i))
            lines.append(f"    u{i}_{j} = (a{i}_{j}{above}) * r{i}")
        forward = "".join(f" - u{r}_{i} * z{r}" for r in range(i))
        lines.append(f"    z{i} = (b{i} + p * m{i}{forward}) * r{i}")
    for i in range(d - 1, -1, -1):
        back = "".join(f" - u{i}_{j} * t{j}" for j in range(i + 1, d))
        lines.append(f"    t{i} = (z{i}{back}) * r{i}")
    lines.append(f"    return [{_names('t', d)}]")
    fn = _compile("\n".join(lines), "ridge_solver")
    return fn  # type: ignore[return-value]
