"""FLOP formulas."""

from ptc.compiler.graph.flops import matmul_flops, sdpa_flops


def test_matmul_is_2mnk():
    assert matmul_flops((2, 16, 64), (2, 16, 256)) == 2 * (2 * 16) * 64 * 256
    assert matmul_flops((8, 16, 32), (8, 16, 16)) == 2 * 8 * 16 * 32 * 16  # bmm


def test_sdpa_is_4_b_heads_s2_d():
    b, a, s, d = 2, 4, 16, 8
    assert sdpa_flops((b, a, s, d), (b, a, s, d), (b, a, s, d)) == 4 * b * a * s * s * d


def test_sdpa_gqa_counts_query_heads():
    assert sdpa_flops((1, 8, 4, 2), (1, 2, 4, 2), (1, 2, 4, 2)) == 4 * 8 * 4 * 4 * 2
