"""Fitting measured quantities as polynomials in b and s (degree <= 1 in b, <= 2 in s)
from the profile's (b, s) points, checked at one more, and turning them into fast
functions."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator, Mapping
from fractions import Fraction

import sympy

from ptc.compiler.graph.gemm_tiles import GemmShape, fit_shapes
from ptc.compiler.profile.types import MONOMIALS, ModelProfile, SavedClasses, b, s


def profile_functions(profile: ModelProfile) -> Mapping[str, Callable]:
    """The profile's polynomials as fast functions of (b, s), by dotted name, each made
    when first asked for: a compile prices a few dozen of the hundreds a profile holds."""
    regions = {**profile.saved, "out": profile.layer_output,
               "out_unsaved": profile.output_unsaved, "in_unsaved": profile.input_unsaved,
               **profile.policy_saved}
    regions.update({f"sp:{r}": cl for r, cl in profile.sp_saved.items()})
    polys = {f"{r}.{c.name}": getattr(cl, c.name) for r, cl in regions.items()
             for c in dataclasses.fields(SavedClasses)}
    polys.update({f"flops.{r}": e for r, e in profile.flops.items()})
    polys.update({f"flops.{p}": e for p, e in profile.policy_flops.items()})
    polys.update(core_flops=profile.core_flops, kv_flops=profile.kv_flops,
                 fp8_flops=profile.fp8_flops,
                 boundary=profile.boundary_elements, sp_gathered=profile.sp_gathered,
                 sp_scattered=profile.sp_scattered)
    makers = {name: functools.partial(sympy.lambdify, (b, s), e, modules="math")
              for name, e in polys.items()}
    # The work terms are many (hundreds) and only ever priced in numbers: plain polynomials
    # of their float coefficients, which take a fraction of lambdify's time to make.
    makers.update({f"{prefix}.{name}": functools.partial(_numeric, e) for prefix, terms in
                   (("work", profile.work), ("work_b1", profile.work_b1))
                   for name, e in terms.items()})
    return MadeOnUse(makers)


class MadeOnUse(Mapping):
    """A mapping of names to functions, each made by its maker the first time it is read."""

    def __init__(self, makers: dict[str, Callable[[], Callable]]):
        self._makers = makers
        self._made: dict[str, Callable] = {}

    def __getitem__(self, name: str) -> Callable:
        made = self._made.get(name)
        if made is None:
            made = self._made[name] = self._makers[name]()
        return made

    def __iter__(self) -> Iterator[str]:
        return iter(self._makers)

    def __len__(self) -> int:
        return len(self._makers)


def _numeric(e: sympy.Expr) -> Callable[[float, float], float]:
    """`e`, a polynomial in b and s, as a function of numbers (b, s)."""
    terms = tuple((float(c), int(m.as_powers_dict().get(b, 0)), int(m.as_powers_dict().get(s, 0)))
                  for m, c in sympy.expand(e).as_coefficients_dict().items())
    return lambda bb, ss: sum(c * bb**i * ss**j for c, i, j in terms)


def profile_points(max_seq: int) -> list[tuple[int, int]]:
    """The (micro-batch, sequence) points a profile captures the model at (comments below)."""
    q = max(1, (min(max_seq, 65) - 1) // 4)
    # A 2 x 3 grid fixes {1, b} x {1, s, s^2}; (4, 4q) checks the fit, its sequence below
    # max_seq (from 5 on): a model that slices a table of max_seq rows to the sequence
    # (GPT-Neo's causal bias) slices it whole at max_seq, a slice the capture drops, so its
    # op count there is one off the polynomial's. Micro-batches 2 and 3:
    # at b = 1 a batched matmul of a transposed operand (q @ k^T written out) saves a view of
    # it, from b = 2 on a copy, so a term that keeps the operand's storage besides (op-level
    # recompute of a norm keeps the qkv output) is polynomial from b = 2 on; at b = 1 it is
    # that storage too high (conservative).
    return [(pb, k * q) for pb in (2, 3) for k in (1, 2, 3)] + [(4, 4 * q)]


def fit_polynomial(points: list[tuple[int, int]], values: list[int]) -> sympy.Expr:
    coeffs = _inverse(tuple(points)) * sympy.Matrix(values)
    return sympy.expand(sum(c * m for c, m in zip(coeffs, MONOMIALS)))


@functools.cache
def _inverse(points: tuple[tuple[int, int], ...]) -> sympy.Matrix:
    """The inverse of the monomials' values at `points` (exact rationals): shared by every
    term fitted at the same points."""
    return sympy.Matrix([[m.subs({b: pb, s: ps}) for m in MONOMIALS] for pb, ps in points]).inv()


def work_points(points: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Where the work terms are measured besides `points`: one sample at the grid's and
    the check's sequence lengths."""
    return [(1, ps) for ps in dict.fromkeys(ps for _, ps in points)]


def fit_work(points: list[tuple[int, int]], samples: dict[tuple[int, int], dict[str, int]]
              ) -> tuple[dict[str, sympy.Expr], dict[str, sympy.Expr], list[str]]:
    """(work for b >= 2 in b and s, work for b = 1 in s, names whose check failed): fitted
    on `points`' grid and checked at its last point, and on one sample at the grid's three
    sequence lengths, checked at the last point's. Solved in exact fractions (hundreds of
    terms: sympy's own solving would take seconds)."""
    ones = work_points(points)
    fits = ((points[:6], points[6], MONOMIALS), (ones[:3], ones[3], MONOMIALS[:3]))
    out: tuple[dict[str, sympy.Expr], dict[str, sympy.Expr]] = ({}, {})
    bad = []
    for name in samples[points[0]]:
        for (grid, check, monomials), fitted in zip(fits, out):
            inverse = _fraction_inverse(tuple(grid), monomials)
            values = [samples[pt][name] for pt in grid]
            coeffs = [sum(x * v for x, v in zip(row, values)) for row in inverse]
            if sum(c * _value(m, check) for c, m in zip(coeffs, monomials)) != samples[check][name]:
                bad.append(name)
            fitted[name[len("work."):]] = sympy.Add(*(sympy.Rational(c.numerator, c.denominator) * m
                                                      for c, m in zip(coeffs, monomials)))
    return *out, bad


def _value(m: sympy.Expr, point: tuple[int, int]) -> int:
    powers = m.as_powers_dict()
    return point[0] ** int(powers.get(b, 0)) * point[1] ** int(powers.get(s, 0))


@functools.cache
def _fraction_inverse(points: tuple[tuple[int, int], ...], monomials: tuple[sympy.Expr, ...]
                      ) -> list[list[Fraction]]:
    """The inverse of `monomials`' values at `points`, in fractions."""
    matrix = sympy.Matrix([[_value(m, pt) for m in monomials] for pt in points]).inv()
    return [[Fraction(int(x.p), int(x.q)) for x in matrix.row(i)] for i in range(matrix.rows)]


def fit_gemms(points: list[tuple[int, int]], samples: dict[tuple[int, int], dict[str, list]]
               ) -> tuple[dict[str, tuple[GemmShape, ...]], dict[str, tuple[GemmShape, ...]]]:
    """`ModelProfile.gemms` and `gemms_b1`: each region's phase's GEMM shapes fitted on the
    points `fit_work` fits (`gemm_tiles.fit_shapes`)."""
    grids = ((points, True), (work_points(points), False))
    out: tuple[dict, dict] = ({}, {})
    for (grid, with_batch), fitted in zip(grids, out):
        for key in samples[grid[0]]:
            if all(key in samples[pt] for pt in grid):
                shapes = fit_shapes({pt: samples[pt][key] for pt in grid}, grid,
                                    with_batch=with_batch)
                if shapes is not None:
                    fitted[key] = shapes
    return out
