"""How far an fp32 result may be from the eager fp32 reference: bounds derived per comparison.

An equivalence test compares a result q (a parallel or transformed program,
in fp32) with r, eager PyTorch computing the same thing in fp32. Two correct
fp32 computations of one function differ by rounding, which depends on the
order of every sum (the layout's, and the CPU's kernels'), so the bound must
come from the case, not from what one CPU happened to give. The reference is
computed a second time in float64, e, from the same fp32 weights on the same
data: e stands for the exact result (its own rounding is 2^29 times finer),
and |r − e| is the fp32 reference's own rounding, measured for this case on
this machine. q is another fp32 computation of the same function, so
|q − e| is of the same kind, and |q − r| <= |q − e| + |r − e|. The bounds are
K = 4 times an estimate of one fp32 run's distance from e: 2 for the two runs
of that triangle inequality, 2 for the spread between the sizes of two runs'
errors (only r's is measured; q's comes from other summation orders).

One evaluation (`rounding_bound`), per tensor: K · max(max|r − e|, u · eps ·
max|e|), eps = 2^-23 the fp32 epsilon. The second term is a floor for when r
happens to land near e: u = 1 for a plain result (no two fp32 results can be
asked to agree closer than an ulp of the tensor's largest element); for a
mean over n terms, such as a loss averaged over tokens, u = sqrt(n): the
rounding of a sum of n terms in any order adds up like a random walk.

A bf16 plan is compared the same way with r the eager run of ptc's bf16
recipe (the model computing in bf16, AdamW on fp32 masters of its weights):
|r − e| is then bf16's rounding of this case, and the bounds grow with it;
a loss computed in bf16 is also allowed K of its own ulps (K · eps_bf16 · |e|):
two bf16 results cannot be asked to agree closer than their spacing. Those
element bounds come out as wide as bf16's largest deviation, so a bf16 run is
held to a second, tighter test per tensor: its median distance from e at most
K times the eager bf16 run's (`assert_params_match`): the same recipe computed
in another order is as far from exact, give or take the K spread. The median,
not the RMS: an element whose gradient is as small as bf16's rounding noise may
step the other way in any correct run (its element bound allows it), and in a
32-element norm weight one such element alone set the RMS of correct runs at
6-7 times eager's (GPT-2 under several layouts, on one CPU); a shift shared by
the typical element still moves the median.

Training (`Reference`, N AdamW steps). The loss of every step is a mean over
the n tokens of the global batch: `rounding_bound` with u = sqrt(n), step by
step (|r − e| of a later step includes what rounding did to the reference's
weights so far). Element i of a parameter tensor T gets the largest of:

- The trajectory's rounding: `rounding_bound` of T with u = N. Each update
  rounds the stored value (half an ulp, <= eps/2 · |p|, in each run), so two
  runs cannot be asked to agree closer than N · eps · max|p|.
- Adam's amplification, A_i. AdamW moves p by lr · u, u = m̂ / (sqrt(v̂) + ε):
  the update is normalised by the gradient's own RMS, so an absolute
  gradient difference δ becomes a relative update difference. To first
  order |Δu_t| <= (1 + C_t) · δ_t / (sqrt(v̂_t) + ε), as |Δm̂| <= δ and
  |Δ sqrt(v̂)| <= δ (m̂ and sqrt(v̂) are weighted means of the gradients and
  of their squares) and |m̂| / sqrt(v̂) <= C_t; and whatever the gradients,
  |u| <= C_t (Cauchy–Schwarz over the moments' weights, `adam_ratio_bound`:
  1 at the first step, at most 1.17 for betas (0.9, 0.95)), so two updates
  differ by at most 2 · C_t. Per step a_t = lr_t · min(2 · C_t, K · (1 + C_t)
  · δ_t / (sqrt(v̂_t) + ε)), with v̂ from the fp64 run, and A = Σ_t a_t. For
  most elements this is far below the rounding term. For an element whose
  gradient is as small as its rounding noise (a sum that cancels, next to
  Adam's ε = 1e-8) the summation order decides where its update points,
  and A reaches the 2 · C_t · lr_t a step that two Adam steps can differ by:
  what such an element may really do, in any correct implementation.
  Weight decay multiplies a difference by 1 − lr·λ <= 1: left out.
  δ_t, the gradient's rounding noise by step t: max |g_r − g_e| over the
  steps so far and over the element's slice along the first dimension (a
  row of a weight matrix: one output feature, one token of an embedding; an
  element of a vector), within which noise is of one size (the query, key
  and value rows of a fused qkv weight differ a hundredfold); the maximum
  over a slice keeps one element's sample landing near 0 by chance from
  setting its bound. δ is 0 while the element's fp64 gradient has been
  exactly 0: nothing was summed into it, so nothing was rounded (the
  embedding rows of tokens not seen).
- What those moves do downstream, 2 · |ẽ − e|_i. An element that moved by
  up to A changes the activations it feeds, hence other tensors' gradients
  and updates (a flipped weight into one hidden unit moves the whole column
  of the next layer's weight reading that unit). ẽ is the fp64 run once more
  with each element whose Adam term exceeds K times its rounding term
  displaced after every step by ±a_t (a fixed random sign per element): it
  moves by its whole Adam bound, and training carries the consequences to
  the rest, which |ẽ − e| measures; 2 as q and r may each have moved. The
  elements left alone may move by no more than a few times what rounding
  moves them, whose consequences |r − e| holds; displacing them as well
  (thousands, with random signs) adds noise that can cancel the signal (it
  did, sixtyfold, at one bias element in a trial).

The loss bound of a step is also at least 2 · |ẽ − e| of that step's loss.
`rounding_bound` and `Reference.loss_bounds` / `Reference.param_bound` give
these numbers; the `assert_*` functions compare and, on a mismatch, name the
tensor, the largest difference, where it is and the bound there, by term.

Used by: training (`dist_helpers.reference` builds a `Reference`) —
`assert_losses_match` and `assert_params_match`, both through
`dist_helpers.assert_same_training`, in tests/distributed test_zero_,
test_pp_, test_tp_ and test_recompute_equivalence, directly in
tests/runtime/test_executor; losses alone in test_launch, test_faults and
test_checkpoint_reshard. One evaluation — `assert_loss_and_grads_match`,
`assert_loss_within_rounding` and `assert_within_rounding` — in tests/passes
test_activation_checkpoint, test_pipeline_split, test_tp_overlap,
test_tensor_parallel and test_zero_pass.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import torch

EPS32 = torch.finfo(torch.float32).eps
K = 4.0
"""2 for the triangle inequality (q and r are both fp32 runs), 2 for the spread of their errors."""
MOVED = 2.0
"""|ẽ − e| counts once for q and once for r."""


@dataclasses.dataclass(frozen=True)
class Step:
    """One optimizer step of an eager run: its learning rate and the clipped gradients."""

    lr: float
    grads: dict[str, torch.Tensor]


@dataclasses.dataclass(frozen=True)
class Run:
    """An eager training run: the loss of every step, the final weights, every step."""

    losses: list[float]
    state: dict[str, torch.Tensor]
    steps: list[Step]


Nudge = Callable[[int], dict[str, torch.Tensor]]
"""After optimizer step t (0-based): what to add to each parameter, by name."""
Train = Callable[[torch.dtype, "Nudge | None"], Run]
"""Eager training of one plan in a dtype, nudged after every step when given."""


def rounding_bound(ref32: torch.Tensor, ref64: torch.Tensor, ulps: float = 1.0) -> float:
    """K · max(max|ref32 − ref64|, ulps · eps32 · max|ref64|): the module docstring's bound."""
    measured = (ref32.double() - ref64).abs().max().item()
    return K * max(measured, ulps * EPS32 * ref64.abs().max().item())


@functools.cache
def adam_ratio_bound(t: int, betas: tuple[float, float]) -> float:
    """C_t, the largest |m̂_t| / sqrt(v̂_t) any gradients give at step t (1-based).

    m̂_t = Σ a_s g_s and v̂_t = Σ b_s g_s² with the bias-corrected weights a_s,
    b_s; by Cauchy–Schwarz |m̂_t| <= sqrt(Σ a_s² / b_s) · sqrt(v̂_t).
    """
    b1, b2 = betas
    return math.sqrt(sum(((1 - b1) * b1 ** (t - s) / (1 - b1 ** t)) ** 2
                         / ((1 - b2) * b2 ** (t - s) / (1 - b2 ** t)) for s in range(1, t + 1)))


class Reference:
    """The eager run of a plan in its precision (compared with), in fp64 (exact) and
    nudged (ẽ).

    `dtype`: float32, or bfloat16 for ptc's bf16 recipe (bf16 compute, fp32 master
    weights); the measured |r − e| is then bf16's rounding, and every bound with it.
    """

    def __init__(self, train: Train, *, betas: tuple[float, float], adam_eps: float,
                 tokens: int, dtype: torch.dtype = torch.float32) -> None:
        self.betas, self.adam_eps = tuple(betas), adam_eps
        self.tokens = tokens
        """Tokens averaged into each step's loss: global batch × sequence length."""
        self.run, self.run64 = train(dtype, None), train(torch.float64, None)
        self.loss_eps = torch.finfo(dtype).eps
        """The loss's own precision: a bf16 loss cannot agree closer than its ulp."""
        steps = len(self.run64.steps)
        self.rounding = {name: rounding_bound(self.run.state[name], exact, steps)
                         for name, exact in self.run64.state.items()}
        """Per parameter, the rounding term."""
        self.adam_steps = {name: self._adam_steps(name) for name in self.run64.state}
        """Per parameter, a_t of every step."""
        gen = torch.Generator().manual_seed(0)
        moved = {name: (sum(a) > K * self.rounding[name])  # Adam's elements, as below
                 * (torch.randint(0, 2, a[0].shape, generator=gen, dtype=a[0].dtype) * 2 - 1)
                 for name, a in self.adam_steps.items()}
        self.nudged = train(torch.float64, lambda t: {
            name: moved[name] * a[t] for name, a in self.adam_steps.items()})

    def loss_bounds(self) -> list[float]:
        """Per step, how far another fp32 run's loss may be from run's."""
        ulps = math.sqrt(self.tokens)
        return [max(rounding_bound(torch.tensor(a), torch.tensor(b, dtype=torch.float64), ulps),
                    K * self.loss_eps * abs(b), MOVED * abs(c - b))
                for a, b, c in zip(self.run.losses, self.run64.losses, self.nudged.losses)]

    def param_terms(self, name: str) -> tuple[float, torch.Tensor, torch.Tensor]:
        """The rounding term of parameter `name`, and per element its Adam and downstream terms."""
        return (self.rounding[name], sum(self.adam_steps[name]),
                MOVED * (self.nudged.state[name] - self.run64.state[name]).abs())

    def param_bound(self, name: str) -> torch.Tensor:
        """Per element of parameter `name`, how far another fp32 run may end from run."""
        rounding, adam, downstream = self.param_terms(name)
        return torch.clamp(torch.maximum(adam, downstream), min=rounding)

    def _adam_steps(self, name: str) -> list[torch.Tensor]:
        """a_t of every step, per element of parameter `name` (the module docstring)."""
        _, b2 = self.betas
        out = []
        noise = v = torch.zeros_like(self.run64.state[name])
        seen = torch.zeros_like(noise, dtype=torch.bool)
        for t, (s32, s64) in enumerate(zip(self.run.steps, self.run64.steps), start=1):
            g = s64.grads[name]
            diff = (s32.grads[name].double() - g).abs()
            if diff.dim() > 1:
                diff = diff.amax(dim=tuple(range(1, diff.dim())), keepdim=True)
            noise = torch.maximum(noise, diff)
            seen = seen | (g != 0)
            v = b2 * v + (1 - b2) * g * g
            rms = (v / (1 - b2 ** t)).sqrt()
            c = adam_ratio_bound(t, self.betas)
            out.append(s64.lr * torch.clamp(
                K * (1 + c) * noise * seen / (rms + self.adam_eps), max=2 * c))
        return out


def _where(diff: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape))


def assert_within_rounding(got: torch.Tensor, ref32: torch.Tensor, ref64: torch.Tensor,
                           what: str, ulps: float = 1.0) -> None:
    """One evaluation: |got − ref32| <= `rounding_bound(ref32, ref64, ulps)` everywhere."""
    assert got.shape == ref32.shape and got.dtype == ref32.dtype, \
        f"{what}: {got.dtype}{list(got.shape)}, the reference is {ref32.dtype}{list(ref32.shape)}"
    bound = rounding_bound(ref32, ref64, ulps)
    diff = (got.double() - ref32.double()).abs()
    if not bool((diff <= bound).all()):  # NaN compares False
        worst = diff.nan_to_num(math.inf)
        raise AssertionError(
            f"{what}: differs by {worst.max().item():.3g} at {_where(worst)}, bound {bound:.3g} = "
            f"{K:g}·max(|ref32 − ref64| {(ref32.double() - ref64).abs().max().item():.3g}, "
            f"{ulps:.3g}·eps·max|ref64| {ulps * EPS32 * ref64.abs().max().item():.3g}); "
            f"{int((~(diff <= bound)).sum())} of {diff.numel()} elements over")


def assert_loss_within_rounding(got: torch.Tensor, ref32: torch.Tensor, ref64: torch.Tensor,
                                what: str, tokens: int) -> None:
    """A loss, a mean over `tokens`: `assert_within_rounding` with u = sqrt(tokens)."""
    assert_within_rounding(got, ref32, ref64, what, math.sqrt(tokens))


def assert_loss_and_grads_match(got: tuple, ref: tuple, exact: tuple, what: str,
                                 tokens: int) -> None:
    """One forward and backward, each a (loss, gradients) pair: all within `rounding_bound`.

    The loss is a mean over `tokens`; gradients come by name (a dict) or in one order.
    """
    assert_loss_within_rounding(got[0], ref[0], exact[0], f"{what}: loss", tokens)
    got_grads, ref_grads, exact_grads = (
        g if isinstance(g, dict) else dict(enumerate(g)) for g in (got[1], ref[1], exact[1]))
    assert got_grads.keys() == ref_grads.keys() == exact_grads.keys(), what
    for name, grad in ref_grads.items():
        assert_within_rounding(got_grads[name], grad, exact_grads[name], f"{what}: gradient {name}")


def assert_losses_match(got: list[float], ref: Reference, what: str, steps: range | None = None,
                        against: list[float] | None = None) -> None:
    """The losses of `steps` (0-based; all by default) within `Reference.loss_bounds`, each.

    Compared with the eager fp32 run, or with `against` (another fp32 run of those steps).
    """
    steps = range(len(ref.run.losses)) if steps is None else steps
    want = [ref.run.losses[step] for step in steps] if against is None else against
    assert len(got) == len(want) == len(steps), \
        f"{what}: {len(got)} losses, {len(want)} to compare with, steps {steps}"
    bounds = ref.loss_bounds()
    for step, loss, other in zip(steps, got, want):
        assert abs(loss - other) <= bounds[step], \
            f"{what}: loss of step {step + 1} is {loss!r}, " \
            f"{'eager' if against is None else 'expected'} {other!r}: differs by " \
            f"{abs(loss - other):.3g}, bound {bounds[step]:.3g} (eager fp32 " \
            f"{ref.run.losses[step]!r}, fp64 {ref.run64.losses[step]!r}, a mean over " \
            f"{ref.tokens} tokens)"


def _assert_as_far_from_exact(got: torch.Tensor, run: torch.Tensor, exact: torch.Tensor,
                              steps: int, what: str) -> None:
    """median|got − exact| <= K · max(median|run − exact|, steps · eps32 · max|exact|)."""
    mine, theirs = _median_abs(got.double() - exact), _median_abs(run.double() - exact)
    bound = K * max(theirs, steps * EPS32 * exact.abs().max().item())
    assert mine <= bound, (f"{what}: median distance from the fp64 run {mine:.3g}, the eager "
                           f"run's {theirs:.3g}: more than {K:g} times as far")


def _median_abs(x: torch.Tensor) -> float:
    return x.abs().flatten().median().item()


def assert_params_match(got: dict[str, torch.Tensor], ref: Reference, what: str) -> None:
    """Every parameter of the reference, element by element within `Reference.param_bound`."""
    for name, want in ref.run.state.items():
        assert name in got, f"{what}: parameter {name} missing from the run"
        value = got[name]
        assert value.shape == want.shape and value.dtype == want.dtype, \
            f"{what}: parameter {name} is {value.dtype}{list(value.shape)}, " \
            f"eager {want.dtype}{list(want.shape)}"
        bound = ref.param_bound(name)
        diff = (value.double() - want.double()).abs()
        if ref.loss_eps > EPS32:
            _assert_as_far_from_exact(value, want, ref.run64.state[name], len(ref.run64.steps),
                                      f"{what}: parameter {name}")
        if bool((diff <= bound).all()):  # NaN compares False
            continue
        at = _where((diff / bound).nan_to_num(math.inf))
        rounding, adam, downstream = ref.param_terms(name)
        raise AssertionError(
            f"{what}: parameter {name} differs by {diff[at].item():.3g} at {at} (eager "
            f"{want[at].item():.4g}, fp64 {ref.run64.state[name][at].item():.4g}), bound there "
            f"{bound[at].item():.3g} = max(rounding {rounding:.3g}, Adam {adam[at].item():.3g}, "
            f"downstream {downstream[at].item():.3g}); largest difference "
            f"{diff.nan_to_num(math.inf).max().item():.3g}, "
            f"{int((~(diff <= bound)).sum())} of {diff.numel()} elements over their bound")
