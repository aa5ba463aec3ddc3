"""Compute priced op by op: the work each op asks for, and its seconds, against hand counts.

Every expected value here is derived by hand from shapes (2·m·n·k for a
matrix product, the bytes of an op's inputs and outputs for a memory-bound
one), not read back from the code under test.
"""

from __future__ import annotations

import dataclasses

import pytest
import sympy
import torch
from torch import fx
from torch.nn import functional as F

from ptc.compiler.cost.compute import PhaseWork, Rates, Split, layer_times, phase_work, rates
from ptc.compiler.profile.types import b, s
from ptc.compiler.profile.cache import model_profile
from ptc.compiler.graph.work import CAUSAL_SHARE, FLASH_BACKWARD, function_work, \
    graph_work
from ptc.plan import HardwareSpec, ModelSpec

pytestmark = pytest.mark.timeout(300)


def meta(*shape, grad=True, dtype=torch.float32):
    return torch.randn(*shape, device="meta", dtype=dtype, requires_grad=grad)


def test_an_element_wise_op_moves_its_inputs_and_output():
    m, n = 48, 80
    x, y = meta(m, n), meta(m, n)
    forward, _ = function_work(lambda: x + y)
    assert (forward.memory, forward.gemm, forward.ops) == (3 * m * n * 4, 0, 1)


def test_a_norm_moves_its_input_weight_bias_output_and_statistics():
    m, h = 24, 40
    x, w, bias = meta(m, h), meta(h), meta(h)
    forward, _ = function_work(lambda: F.layer_norm(x, (h,), w, bias))
    # read x, weight, bias; write y and fp32 mean and rstd of each row
    assert forward.memory == 4 * (m * h + 2 * h + m * h + 2 * m)


def test_a_linear_is_2mnk_forward_and_twice_that_backward():
    m, k, n = 64, 96, 160
    x, w = meta(m, k), meta(n, k)
    forward, backward = function_work(lambda: F.linear(x, w).sum().backward())
    assert forward.gemm == 2 * m * n * k
    assert backward.gemm == 2 * (2 * m * n * k)  # input gradient and weight gradient


def test_views_move_nothing():
    x = meta(8, 6)
    forward, _ = function_work(lambda: x.view(6, 8).transpose(0, 1).unsqueeze(0))
    assert forward.memory == 0 and forward.ops == 3


def test_a_phase_costs_its_gemms_at_the_gemm_rate_and_its_bytes_at_the_memory_rate():
    work = PhaseWork(gemm=3e12, memory=2e9, ops=1000)
    cpu = Rates(gemm=1e12, attention=1e12, fp8=None, memory=1e9, dispatch=1e-5, synchronous=True)
    gpu = dataclasses.replace(cpu, synchronous=False)
    assert work.seconds(cpu) == pytest.approx(3 + 2 + 1000 * 1e-5)
    assert work.seconds(gpu) == pytest.approx(3 + 2)  # the host's 10 ms hide behind 5 s
    busy_host = dataclasses.replace(gpu, dispatch=0.01)
    assert work.seconds(busy_host) == pytest.approx(1000 * 0.01)  # 10 s of dispatch > 5 s


def test_a_fused_attention_kernel_runs_at_its_own_share_of_peak_where_one_is_given():
    """Without `attention_fraction` the attention kernel's matrix products run at the GEMM
    rate (measured or not); with it, at peak x that share x the power limit's clock share,
    so only the attention FLOPs of a phase take longer."""
    hw = HardwareSpec.preset("H100-SXM")
    assert rates(hw, "bf16").attention == rates(hw, "bf16").gemm
    measured = dataclasses.replace(hw, gemm_flops={"bf16": 7e14})
    assert rates(measured, "bf16").attention == 7e14
    flash2 = dataclasses.replace(hw, attention_fraction=0.3, power_limit=500.0)
    r = rates(flash2, "bf16")
    assert r.attention == pytest.approx(989e12 * 0.3 * flash2.clock_share)
    assert r.gemm == pytest.approx(989e12 * hw.achievable_fraction * flash2.clock_share)
    work = PhaseWork(gemm=3e12, attention=2e12, memory=1e9)
    full = dataclasses.replace(r, attention=r.gemm)
    assert work.seconds(r) - work.seconds(full) == pytest.approx(2e12 / r.attention
                                                                 - 2e12 / r.gemm)


def test_rates_come_from_the_hardware():
    hw = HardwareSpec.preset("H100-SXM")
    r = rates(hw, "bf16")
    assert r.gemm == pytest.approx(989e12 * hw.achievable_fraction)
    assert r.memory == hw.mem_bandwidth and not r.synchronous
    measured = dataclasses.replace(hw, gemm_flops={"bf16": 7e14}, dispatch_overhead=4e-6)
    assert rates(measured, "bf16").gemm == 7e14 and rates(measured, "bf16").dispatch == 4e-6
    assert rates(HardwareSpec.preset("cpu"), "fp32").synchronous


def documented_clock_share(power_limit: float, board_power: float) -> float:
    """The curve docs/cost-model.md ("Power limits") states: dynamic power ~ f·V², V ~ f,
    so a capped part's clock is (power limit / board power)^(1/3) of its full-power one."""
    return (power_limit / board_power) ** (1 / 3)


def test_a_power_limit_lowers_the_matrix_products_rates_by_the_clock_it_sustains():
    full, capped = HardwareSpec.preset("H100-SXM"), HardwareSpec.preset("H100-SXM",
                                                                        power_limit=500.0)
    share = documented_clock_share(500, 700)
    for dtype in ("bf16", "fp8"):
        r, rc = rates(full, dtype), rates(capped, dtype)
        assert rc.gemm == pytest.approx(r.gemm * share)
        assert (rc.fp8 or 0) == pytest.approx((r.fp8 or 0) * share)
        assert (rc.memory, rc.dispatch, rc.multiprocessors) == \
            (r.memory, r.dispatch, r.multiprocessors)
    at_board = HardwareSpec.preset("H100-SXM", power_limit=700.0)
    assert rates(at_board, "bf16") == rates(full, "bf16")


GPT = ModelSpec(family="gpt", layers=1, hidden=64, heads=4, vocab=128, max_seq=64)
LLAMA = ModelSpec(family="llama", layers=1, hidden=64, heads=4, kv_heads=4, ffn=128, vocab=128,
                  max_seq=64)


def test_a_gpt_layers_gemms_are_its_linears_and_its_written_out_attention():
    h = GPT.hidden
    work = model_profile(GPT, "fp32").work
    # qkv (h -> 3h), out (h -> h), up (h -> 4h), down (4h -> h); q·kᵀ and p·v, 2·b·s²·h each
    linears, attention = 2 * b * s * (3 * h * h + h * h + 4 * h * h * 2), 2 * (2 * b * s**2 * h)
    assert sympy.expand(work["layer.fwd.gemm.all"] - (linears + attention)) == 0
    assert sympy.expand(work["layer.bwd.gemm.all"] - 2 * (linears + attention)) == 0
    assert sympy.expand(work["core.fwd.gemm.all"] - attention) == 0
    assert work["layer.fwd.attn.all"] == 0  # written out: no fused attention kernel
    assert work["layer.fwd.gemm.tp"] == work["layer.fwd.gemm.all"]  # every GEMM splits over tp


def test_sdpa_runs_as_flash_attention():
    h = LLAMA.hidden
    work = model_profile(LLAMA, "fp32").work
    flash = 4 * b * s**2 * h / CAUSAL_SHARE  # 2·(b·a·s)·s·(d + d), causal: half the tiles
    assert sympy.expand(work["layer.fwd.attn.all"] - flash) == 0
    assert sympy.expand(work["layer.bwd.attn.all"] - FLASH_BACKWARD * flash) == 0
    # no s x s scores pass through memory: the layer's bytes grow with s, not s²
    assert sympy.degree(work["layer.fwd.mem.all"], s) == 1


@pytest.mark.parametrize("causal", [False, True])
def test_a_causal_flash_kernel_skips_the_tiles_above_the_diagonal(causal):
    """SDPA's FLOPs are 4·b·a·s²·d forward and 2.5 times that backward; with `is_causal`
    the kernel computes only the tiles on and below the diagonal: half of them."""

    class Attention(torch.nn.Module):
        def forward(self, q):
            return F.scaled_dot_product_attention(q, q, q, is_causal=causal).sum()

    q = torch.empty(2, 4, 16, 8, device="meta", requires_grad=True)
    (work,) = [w for w in graph_work(fx.symbolic_trace(Attention()), [q]).values()
               if w.forward.attention]
    full = 4 * 2 * 4 * 16**2 * 8
    assert work.forward.attention == full / (CAUSAL_SHARE if causal else 1)
    assert work.backward.attention == FLASH_BACKWARD * work.forward.attention


@pytest.mark.parametrize("family", ["llama", "gpt"])
def test_context_parallelism_prices_the_keys_before_each_chunk(family):
    """Under cp, each of a rank's query chunks meets the keys up to its own end through a
    mask (`ptc.ops.context`): `key_tile_share(cp)` of every tile of the whole sequence's
    core, twice the profile's where the model's causal kernel skips half (Llama's SDPA;
    GPT's written-out attention computes every score)."""
    spec, quantity = (LLAMA, "attention") if family == "llama" else (GPT, "gemm")
    profile = model_profile(spec, "fp32")
    assert profile.causal_kernel == (family == "llama")
    every_tile = CAUSAL_SHARE if profile.causal_kernel else 1
    core = profile.fn[f"work.core.fwd.{'attn' if family == 'llama' else 'gemm'}.all"]
    for cp in (2, 4):
        local = getattr(phase_work(profile, "layer", "fwd", 2, 32 // cp,
                                   Split(1, 1, False, 1), 32 // cp), quantity)
        split = getattr(phase_work(profile, "layer", "fwd", 2, 32 // cp,
                                   Split(1, 1, False, cp), 32), quantity)
        want = every_tile * core(2, 32) * (2 * cp + 1) / (4 * cp * cp) - core(2, 32 // cp)
        assert split - local == pytest.approx(want)


def test_tensor_parallelism_splits_the_blocks_and_leaves_the_norms_whole():
    profile = model_profile(GPT, "fp32")
    whole, tp_part = (profile.fn[f"work.layer.fwd.mem.{c}"](2, 32) for c in ("all", "tp"))
    assert 0 < tp_part < whole
    one = phase_work(profile, "layer", "fwd", 2, 32, Split(1, 1, False, 1), 32)
    two = phase_work(profile, "layer", "fwd", 2, 32, Split(2, 2, False, 1), 32)
    two_sp = phase_work(profile, "layer", "fwd", 2, 32, Split(2, 2, True, 1), 32)
    assert two.gemm == pytest.approx(one.gemm / 2)
    assert two.memory == pytest.approx(whole - tp_part + tp_part / 2)  # norms replicated
    assert two_sp.memory == pytest.approx(whole / 2)  # sequence parallel splits them too
    assert two.ops == one.ops  # every rank dispatches every op


def test_a_layer_costs_its_work_at_the_rates():
    profile = model_profile(GPT, "fp32")
    r = Rates(gemm=2e10, attention=2e10, fp8=None, memory=5e9, dispatch=8e-6, synchronous=True)
    t = layer_times(profile, r, bb=2, ss=32, seq_len=32, split=Split(1, 1, False, 1))
    f = profile.fn

    def hand(region, phase):
        g, m, n = (f[f"work.{region}.{phase}.{q}.all"](2, 32) for q in ("gemm", "mem", "ops"))
        return g / 2e10 + m / 5e9 + n * 8e-6

    assert t.forward == pytest.approx(hand("layer", "fwd"))
    assert t.backward == pytest.approx(hand("layer", "bwd"))
    assert t.core == pytest.approx(hand("core", "fwd"))
    assert t.pre == pytest.approx(hand("pre", "fwd") + hand("pre", "bwd"))
    assert t.post == pytest.approx(hand("post", "fwd") + hand("post", "bwd"))


def test_a_capped_layer_pays_the_slower_clock_on_its_gemms_only():
    """A layer's seconds under a 250 W cap on a 400 W A100, against the hand sum of its
    GEMM FLOPs at the capped rate and its bytes at the unchanged bandwidth."""
    profile = model_profile(GPT, "bf16")
    hw = HardwareSpec.preset("A100-80GB", power_limit=250.0)
    r = dataclasses.replace(rates(hw, "bf16"), multiprocessors=0)  # FLOPs alone: by hand
    t = layer_times(profile, r, bb=2, ss=32, seq_len=32, split=Split(1, 1, False, 1))
    gemm = 312e12 * hw.achievable_fraction * documented_clock_share(250, 400)
    f = profile.fn

    def hand(phase):
        g, a, m = (f[f"work.layer.{phase}.{q}.all"](2, 32) for q in ("gemm", "attn", "mem"))
        return (g + a) / gemm + m / hw.mem_bandwidth

    assert t.forward == pytest.approx(hand("fwd"))
    assert t.backward == pytest.approx(hand("bwd"))


def test_one_sample_micro_batches_have_their_own_terms():
    """torch's matmul views an operand at one sample that it copies at more: the b = 1 terms
    are fitted on their own, and they match the general ones but for those copies."""
    profile = model_profile(GPT, "fp32")
    f = profile.fn
    assert f["work_b1.layer.fwd.gemm.all"](1, 48) == f["work.layer.fwd.gemm.all"](1, 48)
    assert f["work_b1.layer.fwd.mem.all"](1, 48) <= f["work.layer.fwd.mem.all"](1, 48)


def test_a_chain_of_element_wise_ops_fuses_into_one_kernel_moving_its_ends_once():
    m, n = 48, 80
    x, y = meta(m, n, grad=False), meta(m, n, grad=False)
    forward, _ = function_work(lambda: ((x + y) * 2).relu())
    # three ops, each its own kernel: read and write every tensor; fused: read x and y, write
    # the result, once
    assert forward.memory == (3 + 2 + 2) * m * n * 4 and forward.ops == 3
    assert forward.fused_memory == 3 * m * n * 4 and forward.kernels == 1


def test_a_gemm_ends_a_fused_kernel_and_what_backward_reads_is_written():
    m, k, n = 32, 64, 96
    x, w = meta(m, k), meta(n, k)

    def layer():
        h = F.linear(x, w)
        return F.gelu(h * 3).sum().backward()

    forward, _ = function_work(layer)
    # the mul reads the GEMM's output; its own output is gelu's input, which gelu's backward
    # reads: written; gelu's output only the sum reads (fused away); the sum writes a scalar
    assert forward.kernels == 2  # the GEMM, then one kernel for mul, gelu and sum
    assert forward.fused_memory == (m * n + m * n + 1) * 4


def test_dropout_runs_as_one_fused_kernel_with_a_one_byte_mask():
    """GPT with dropout against without, fp32, fused: dropout joins the chain it sits in."""
    h, a = GPT.hidden, GPT.heads
    work = model_profile(dataclasses.replace(GPT, dropout=0.1), "fp32").work
    plain = model_profile(GPT, "fp32").work

    def extra(phase):
        return sympy.expand(work[f"layer.{phase}.fmem.all"] - plain[f"layer.{phase}.fmem.all"])

    # forward: the probabilities' dropout writes its output (p @ v reads it) beside the
    # softmax's (its backward reads that), and a 1-byte mask; the two dropouts after the
    # row-parallel linears write only their masks (the residual add beside them reads the
    # output)
    assert extra("fwd") == sympy.expand(b * a * s**2 * (4 + 1) + 2 * b * s * h)
    # backward: each reads its mask; after those two linears the gradient is a tensor of its
    # own (without dropout the add hands its input gradient on unchanged)
    assert extra("bwd") == sympy.expand(b * a * s**2 + 2 * b * s * h * (1 + 4))
    assert work["layer.fwd.kern.all"] == plain["layer.fwd.kern.all"]


def test_fused_pricing_follows_runtime_compile():
    profile = model_profile(GPT, "fp32")
    r = Rates(gemm=2e10, attention=2e10, fp8=None, memory=5e9, dispatch=8e-6, synchronous=True)
    eager = layer_times(profile, r, bb=2, ss=32, seq_len=32, split=Split(1, 1, False, 1))
    fused = layer_times(profile, r, bb=2, ss=32, seq_len=32, split=Split(1, 1, False, 1),
                        fused=True)
    f = profile.fn

    def hand(q_mem, q_ops):
        g, m, n = (f[f"work.layer.fwd.{q}.all"](2, 32) for q in ("gemm", q_mem, q_ops))
        return g / 2e10 + m / 5e9 + n * 8e-6

    assert eager.forward == pytest.approx(hand("mem", "ops"))
    assert fused.forward == pytest.approx(hand("fmem", "kern"))
    assert fused.forward < eager.forward


def test_a_policy_recomputes_the_work_of_the_ops_its_regions_rerun():
    h = GPT.hidden
    profile = model_profile(GPT, "fp32")
    work = profile.work
    # `ops` keeps every matmul's output: its recompute runs no GEMM, only memory-bound ops
    assert work["rerun[ops].fwd.gemm.all"] == 0 < work["rerun[ops].fwd.mem.all"]
    # `modules(mlp)` reruns the MLP's up and down projections (h -> 4h -> h) and what is
    # between them
    assert sympy.expand(work["rerun[modules(mlp)].fwd.gemm.all"] - 2 * (2 * b * s * 4 * h * h)) == 0
    r = Rates(gemm=2e10, attention=2e10, fp8=None, memory=5e9, dispatch=8e-6, synchronous=True)
    t = layer_times(profile, r, bb=2, ss=32, seq_len=32, split=Split(1, 1, False, 1))
    f = profile.fn
    mlp = sum(f[f"work.rerun[modules(mlp)].fwd.{q}.all"](2, 32) / rate
              for q, rate in (("gemm", 2e10), ("mem", 5e9))) \
        + f["work.rerun[modules(mlp)].fwd.ops.all"](2, 32) * 8e-6
    assert t.recompute["modules(mlp)"] == pytest.approx(mlp)
    assert (t.recompute["none"], t.recompute["selective"], t.recompute["full"]) == \
        (0.0, t.core, t.forward)
