"""Golden errors: each malformed plan gives a known message at a known line and column."""

from __future__ import annotations

import pytest
from dsl_helpers import BASE, edit, errors, find

from ptc.dsl import parse

BASE_LINES = BASE.count("\n")

# (id, plan text, stable part of the message, line, column, some valid choices)
GOLDEN = [
    # --- syntax
    ("missing-brace", edit("  max_seq = 512\n}\n", "  max_seq = 512\n"),
     "unexpected '{'; expected '=' (is the '}' of the section opened at line 2 missing?)",
     11, 10, ()),
    ("missing-value", edit("layers = 8", "layers ="),
     "unexpected end of line; expected a value", 3, 11, ()),
    ("bad-token", edit("hidden = 256", "hidden = 256 $"),
     "unexpected character '$'", 4, 16, ()),
    ("missing-equals", edit("heads = 8", "heads 8"),
     "unexpected number 8; expected '='", 5, 9, ()),
    ("unclosed-paren-at-eof", BASE.split("3e-4)")[0] + "3e-4",
     "unexpected end of file; expected ',' or ')' "
     "(the '(' at line 33, column 20 is never closed with ')')", 33, 30, ()),
    ("unclosed-paren-before-brace", edit("adamw(lr = 3e-4)", "adamw(lr = 3e-4"),
     "unexpected '}'; expected ',' or ')' (the '(' at line 33, column 20 is never closed",
     34, 1, ()),
    ("unterminated-string", edit('gpu = "H100-SXM"', 'gpu = "H100-SXM'),
     "unexpected unterminated string", 13, 9, ()),
    ("unquoted-dash-name", edit('gpu = "H100-SXM"', "gpu = H100-SXM"),
     'a name with "-" is written as a string', 13, 13, ()),
    ("too-deep", edit("adamw(lr = 3e-4)", "adamw(lr = " + "(" * 40 + ")" * 40 + ")"),
     "brackets nested more than 32 deep", 33, 57, ()),
    # --- sections and keys
    ("unknown-section", edit("runtime {", "runtme {"),
     "unknown section 'runtme'; did you mean 'runtime'?", 36, 1, ("runtime", "parallel")),
    ("duplicate-section", BASE + "runtime {\n  keep = 2\n}\n",
     "duplicate section 'runtime' (first at line 36)", 40, 1, ()),
    ("missing-section", edit(BASE[BASE.index("train {"):BASE.index("runtime {")], ""),
     "missing required section 'train' (it needs at least seq_len, global_batch)",
     BASE_LINES - 8, 1, ()),
    ("unknown-family", edit("model llama {", "model lama {"),
     "unknown model family 'lama'; did you mean 'llama'?", 2, 7, ("gpt", "llama")),
    ("section-with-name", edit("hardware {", "hardware h100 {"),
     "hardware takes no name", 12, 10, ()),
    ("unknown-key", edit("vocab = 1000", "vocabs = 1000"),
     "unknown key 'vocabs' in model; did you mean 'vocab'?", 8, 3, ("vocab", "layers")),
    ("key-in-wrong-section", edit("steps = 10", "steps = 10\n  tp = 2"),
     "unknown key 'tp' in train; tp belongs in the parallel section", 33, 3, ("seq_len",)),
    ("duplicate-key", edit("zero = 1", "zero = 1\n  zero = 2"),
     "duplicate key 'zero' (first set at line 22)", 23, 3, ()),
    ("missing-key", edit("  vocab = 1000\n", ""),
     "model is missing required key 'vocab' (e.g. vocab = 32000)", 2, 1, ()),
    ("llama-needs-ffn", edit("  ffn = 688\n", ""),
     "model is missing required key 'ffn'", 2, 1, ()),
    # --- kinds and units
    ("wrong-type-string", edit("tp = 2", 'tp = "2"'),
     'tp must be an integer or auto, got "2" (a string)', 19, 8, ()),
    ("wrong-type-bool", edit("zero = 1", "zero = 1\n  overlap = 1"),
     "overlap must be true or false, got 1 (an integer)", 23, 13, ("true", "false")),
    ("wrong-type-float", edit("steps = 10", "steps = 10.5"),
     "steps must be an integer, got 10.5 (a number)", 32, 11, ()),
    ("wrong-dimension", edit("nodes = 1", "nodes = 1\n  hbm = 3 ms"),
     "hbm expects bytes (e.g. 80 GiB, 40 GB), got 3 ms, which is a time", 15, 9, ("GiB",)),
    ("unit-on-integer", edit("tp = 2", "tp = 4 GB"),
     "tp is an integer or auto without a unit, got 4 GB (bytes)", 19, 8, ()),
    ("unknown-unit", edit("nodes = 1", "nodes = 1\n  hbm = 80 GX"),
     "unknown unit 'GX'; did you mean 'GB'?", 15, 12, ("GB", "GiB")),
    ("missing-unit", edit("nodes = 1", "nodes = 1\n  hbm = 80"),
     "hbm needs a unit of bytes, e.g. hbm = 80 GiB", 15, 9, ()),
    ("glued-unit", edit("nodes = 1", "nodes = 1\n  mem_bandwidth = 3350GB"),
     "write a space between the number and the unit, 3350 GB", 15, 19, ()),
    ("link-wrong-unit", edit("nodes = 1", "nodes = 1\n  intra = link(bandwidth = 450 GB, "
                                          "latency = 2 us)"),
     "bandwidth expects a bandwidth (e.g. 450 GB/s, 400 Gb/s), got 450 GB, which is bytes",
     15, 28, ("GB/s",)),
    ("integer-too-large", edit("layers = 8", "layers = 99999999999999999999"),
     "integer 99999999999999999999 is too large", 3, 12, ()),
    ("float-overflow", edit("adamw(lr = 3e-4)", "adamw(lr = 1e999)"),
     "number 1e999 is too large to represent", 33, 26, ()),
    # --- choices and ranges
    ("bad-schedule", edit("schedule = 1f1b", "schedule = 1f2b"),
     "unknown schedule '1f2b'; did you mean '1f1b'?", 23, 14, ("gpipe", "1f1b", "interleaved")),
    ("bad-dtype", edit("dtype = bf16", "dtype = bf61"),
     "dtype = bf61 is not a valid choice", 31, 11, ("fp32", "bf16", "fp16")),
    ("fp8-recipe-delayed", edit("dtype = bf16", "dtype = fp8\n  fp8_recipe = rowwise"),
     "fp8_recipe = rowwise scales current only: fp8_scaling must be current, got delayed",
     32, 16, ("current",)),
    ("fp8-recipe-delayed-written", edit("dtype = bf16", "dtype = fp8\n  fp8_recipe = mxfp8\n"
                                        "  fp8_scaling = delayed"),
     "fp8_recipe = mxfp8 scales current only: fp8_scaling must be current, got delayed",
     33, 17, ("current",)),
    ("bad-fp8-recipe", edit("dtype = bf16", "dtype = fp8\n  fp8_recipe = blockwise"),
     "fp8_recipe = blockwise is not a valid choice", 32, 16, ("tensorwise", "rowwise", "mxfp8")),
    ("bad-norm", edit("max_seq = 512", "max_seq = 512\n  norm = batchnorm"),
     "norm = batchnorm is not a valid choice", 10, 10, ("layernorm", "rmsnorm")),
    ("bad-nan-policy", edit("nan_policy = rollback", "nan_policy = retry"),
     "nan_policy = retry is not a valid choice", 38, 16, ("stop", "skip", "rollback")),
    ("bad-shard-style", edit("checkpoint = selective",
                             'checkpoint = selective\n  shard "layers.*.mlp.up" colwize'),
     "style = colwize is not a valid choice; did you mean 'colwise'?", 25, 27,
     ("colwise", "rowwise", "replicate", "vocab")),
    ("bad-optimizer", edit("adamw(lr = 3e-4)", "adam(lr = 3e-4)"),
     "unknown optimizer 'adam'; did you mean 'adamw'?", 33, 15, ("adamw", "sgd")),
    ("bad-optimizer-argument", edit("adamw(lr = 3e-4)", "adamw(lr = 3e-4, beta = (0.9, 0.95))"),
     "unknown argument 'beta' of adamw; did you mean 'betas'?", 33, 32, ("betas",)),
    ("bad-gpu", edit('gpu = "H100-SXM"', 'gpu = "H100"'),
     'gpu = "H100" is not a valid choice; did you mean \'H100-SXM\'?', 13, 9,
     ("H100-SXM", "custom")),
    ("zero-out-of-range", edit("zero = 1", "zero = 4"),
     "zero must be a stage 0-3, got 4", 22, 10, ("0", "3")),
    ("offload-needs-zero", edit("zero = 1", "zero = 0\n  offload = optimizer"),
     "offload = optimizer needs zero 1-3: each rank offloads the shard of the optimizer it "
     "owns, got zero = 0", 23, 13, ("none",)),
    ("negative-micro-batch", edit("micro_batch = 1", "micro_batch = -1"),
     "micro_batch must be >= 1, got -1", 30, 17, ()),
    ("rollback-without-checkpoint-dir", edit('  checkpoint_dir = "ckpt"\n', ""),
     "nan_policy = rollback needs checkpoint_dir to roll back to", 37, 16, ()),
    # --- cross-section checks
    ("mesh-product", edit("pp = 2", "pp = 4"),
     "tp(2) * pp(4) * dp(2) = 16 != 8 GPUs", 19, 8, ()),
    ("heads-vs-tp", edit("heads = 8", "heads = 12", "hidden = 256", "hidden = 384",
                         "tp = 2", "tp = 8", "pp = 2", "pp = 1", "dp = 2", "dp = 1"),
     "heads(12) is not divisible by tp(8)", 19, 8, ("1", "2", "3", "4", "6", "12")),
    ("kv-heads-vs-tp", edit("heads = 8", "heads = 24", "hidden = 256", "hidden = 384",
                            "kv_heads = 4", "kv_heads = 6", "tp = 2", "tp = 4", "dp = 2", "dp = 1"),
     "kv_heads(6) and tp(4): neither divides the other", 19, 8, ()),
    ("layers-vs-pp-times-v", edit("schedule = 1f1b", "schedule = interleaved(virtual_stages = 3)"),
     "layers(8) is not divisible by pp(2) * virtual_stages(3) = 6", 20, 8, ()),
    ("global-batch", edit("global_batch = 16", "global_batch = 15"),
     "global_batch(15) is not divisible by micro_batch(1) * dp(2) = 2", 29, 18, ()),
    ("microbatches-below-pp", edit("global_batch = 16", "global_batch = 2"),
     "schedule 1f1b needs at least pp(2) micro-batches, got 1", 23, 14, ()),
    ("seq-len-above-max-seq", edit("seq_len = 512", "seq_len = 1024"),
     "seq_len(1024) > model max_seq(512)", 28, 13, ()),
    ("checkpoint-overlap", edit("checkpoint = selective",
                                "checkpoint = layers(full = 0..4, selective = 4..7)"),
     "layer 4 is given two policies: full (column 30) and selective", 24, 48, ()),
    ("checkpoint-gap", edit("checkpoint = selective",
                            "checkpoint = layers(full = 0..3, selective = 5..7)"),
     "layers without a checkpoint policy: 4 (every layer 0..7 needs exactly one)", 24, 16, ()),
    ("checkpoint-beyond-model", edit("checkpoint = selective", "checkpoint = layers(full = 0..9)"),
     "layers 0..9 are out of range (the model has 8 layers, 0..7)", 24, 30, ()),
    ("checkpoint-list-length", edit("checkpoint = selective", "checkpoint = [full, none]"),
     "per-layer checkpoint lists 2 entries for 8 layers", 24, 16, ()),
    ("zero-bubble-compiled", edit("schedule = 1f1b", "schedule = zero_bubble",
                                  "nan_policy = rollback",
                                  "nan_policy = rollback\n  compile = true"),
     "schedule zero_bubble needs runtime.compile = false", 39, 13, ("false",)),
    ("zero-bubble-chunks-twice", edit("schedule = 1f1b",
                                      "schedule = zero_bubble(virtual_stages = 2)"
                                      "\n  virtual_stages = 4"),
     "virtual_stages is 4 but the schedule says zero_bubble(virtual_stages = 2)", 24, 20, ()),
    ("zbv-three-chunks", edit("schedule = 1f1b", "schedule = zbv\n  virtual_stages = 3"),
     "schedule zbv places two chunks per rank in a V: virtual_stages must be 2, got 3",
     24, 20, ("2",)),
    ("zbv-with-arguments", edit("schedule = 1f1b", "schedule = zbv(virtual_stages = 2)"),
     "unknown argument 'virtual_stages' of zbv; it takes no arguments", 23, 18, ()),
    ("zbv-first-stage-layers", edit("schedule = 1f1b", "schedule = zbv\n  first_stage_layers = 2"),
     "first_stage_layers splits the first and the last rank's layers; schedule zbv puts the "
     "first and the last stage on one rank: pin the cuts with stage_boundaries", 24, 24, ()),
    ("dualpipev-one-micro-batch-per-stage", edit("schedule = 1f1b", "schedule = dualpipev",
                                                 "global_batch = 16", "global_batch = 4"),
     "schedule dualpipev needs at least 2 * pp(2) = 4 micro-batches, one per stage, got 2",
     23, 14, ()),
    ("virtual-stages-twice", edit("schedule = 1f1b", "schedule = interleaved(virtual_stages = 2)"
                                  "\n  virtual_stages = 4"),
     "virtual_stages is 4 but the schedule says interleaved(virtual_stages = 2)", 24, 20, ()),
    # --- tensor-parallel communication
    ("tp-comm-unknown", edit("zero = 1", "zero = 1\n  tp_comm = overlapped"),
     "tp_comm", 23, 13, ("sync", "async")),
    ("tp-comm-async-without-sp", edit("zero = 1", "zero = 1\n  tp_comm = async"),
     "tp_comm = async needs sequence_parallel = true", 23, 13, ("sync",)),
    ("tp-comm-async-without-overlap", edit("zero = 1", "zero = 1\n  tp_comm = async\n"
                                           "  sequence_parallel = true\n  overlap = false"),
     "tp_comm = async needs overlap = true", 23, 13, ("sync",)),
    # --- power limits
    ("power-limit-above-board-power", edit("nodes = 1", "nodes = 1\n  power_limit = 800 W"),
     "power_limit = 800 W is outside H100-SXM's range, 200 W to 700 W", 15, 17, ()),
    ("power-limit-below-minimum", edit("nodes = 1", "nodes = 1\n  power_limit = 150 W"),
     "power_limit = 150 W is outside H100-SXM's range, 200 W to 700 W", 15, 17, ()),
    ("power-limit-without-unit", edit("nodes = 1", "nodes = 1\n  power_limit = 500"),
     "power_limit needs a unit of a power, e.g. power_limit = 500 W", 15, 17, ("W", "kW")),
    ("power-limit-wrong-dimension", edit("nodes = 1", "nodes = 1\n  power_limit = 500 GB"),
     "power_limit expects a power (e.g. 500 W, 1.2 kW), got 500 GB, which is bytes",
     15, 17, ("W",)),
    ("power-limit-on-a-cpu", edit('gpu = "H100-SXM"', "gpu = cpu\n  power_limit = 100 W"),
     "power_limit caps a GPU's power; a CPU has none (remove power_limit)", 14, 17, ()),
    ("power-limit-of-a-custom-gpu", edit('gpu = "H100-SXM"', """gpu = custom
  hbm = 24 GiB
  peak = flops(bf16 = 165 TFLOP/s)
  mem_bandwidth = 1000 GB/s
  intra = link(bandwidth = 32 GB/s, latency = 5 us)
  inter = link(bandwidth = 25 GB/s, latency = 5 us)
  power_limit = 300 W"""),
     "power_limit needs the part's board_power (its full power, e.g. board_power = 700 W)",
     19, 17, ()),
]


@pytest.mark.parametrize("text, needle, line, column, choices",
                         [g[1:] for g in GOLDEN], ids=[g[0] for g in GOLDEN])
def test_golden_error(text: str, needle: str, line: int, column: int,
                      choices: tuple[str, ...]) -> None:
    d = find(errors(text), needle)
    assert (d.span.line, d.span.column) == (line, column), d.render()
    assert d.span.file == "plan.ptc"
    assert d.span.source_line == text.split("\n")[line - 1]
    assert set(choices) <= set(d.choices), d.choices
    rendered = d.render()
    assert rendered.startswith(f"plan.ptc:{line}:{column}: error: ")
    if d.span.source_line:  # the end of a file is an empty line: nothing to underline
        assert "\n    " + " " * (column - 1) + "^" in rendered


def test_every_power_limit_error_is_one_line_naming_the_field() -> None:
    for name, text, *_ in GOLDEN:
        if name.startswith("power-limit"):
            (d,) = errors(text)
            assert d.field == "hardware.power_limit" and "\n" not in d.message, name


def test_golden_count() -> None:
    assert len(GOLDEN) >= 25


def test_unknown_key_is_not_also_reported_missing() -> None:
    diagnostics = errors(edit("vocab = 1000", "vocabs = 1000"))
    assert len(diagnostics) == 1


def test_custom_gpu_reports_each_missing_field_at_the_header() -> None:
    diagnostics = errors(edit('gpu = "H100-SXM"', "gpu = custom\n  hbm = 80 GiB"))
    missing = sorted(d.message.split("'")[1] for d in diagnostics)
    assert missing == ["inter", "intra", "mem_bandwidth", "peak"]
    assert all((d.span.line, d.span.column) == (12, 1) for d in diagnostics)
    assert all("when gpu = custom" in d.message for d in diagnostics)


def test_custom_gpu_with_every_field_is_valid() -> None:
    plan = parse(edit('gpu = "H100-SXM"', """gpu = custom
  hbm = 24 GiB
  peak = flops(bf16 = 165 TFLOP/s, fp32 = 82 TFLOP/s)
  mem_bandwidth = 1008 GB/s
  intra = link(bandwidth = 32 GB/s, latency = 10 us)
  inter = link(bandwidth = 100 Gb/s, latency = 20 us)"""))
    assert plan.hardware.hbm_bytes == 24 * 2**30
    assert plan.hardware.inter.bandwidth == 12.5e9


def test_tp_spanning_nodes_is_a_warning_only() -> None:
    plan = parse(edit("nodes = 1", "nodes = 2", "gpus_per_node = 8", "gpus_per_node = 4",
                      "tp = 2", "tp = 8", "pp = 2", "pp = 1", "dp = 2", "dp = 1"), "plan.ptc")
    (warning,) = plan.warnings
    assert warning.severity == "warning"
    assert "tp(8) > gpus_per_node(4)" in warning.message
    assert (warning.span.line, warning.span.column) == (19, 8)


def test_every_error_of_a_file_is_reported_in_order() -> None:
    text = edit("vocab = 1000", "vocab_size = 1000", "nodes = 1", "nodes = 1\n  hbm = 3 ms",
                "dtype = bf16", "dtype = bf17", "zero = 1", "zero = 7",
                "nan_policy = rollback", "nan_policy = retry")
    diagnostics = errors(text)
    assert [d.span.line for d in diagnostics] == [8, 15, 23, 32, 39]
    assert [d.message.split(" ")[0] for d in diagnostics] == [
        "unknown", "hbm", "zero", "dtype", "nan_policy"]


def test_cross_section_errors_are_all_reported() -> None:
    diagnostics = errors(edit("pp = 2", "pp = 3", "global_batch = 16", "global_batch = 15"))
    messages = " | ".join(d.message for d in diagnostics)
    assert "tp(2) * pp(3) * dp(2) = 12 != 8 GPUs" in messages
    assert "layers(8) is not divisible by pp(3)" in messages
    assert "global_batch(15) is not divisible" in messages


def test_mesh_error_without_parallel_section_points_at_hardware() -> None:
    start, end = BASE.index("parallel {"), BASE.index("train {")
    d = find(errors(edit(BASE[start:end], "")), "tp(1) * pp(1) * dp(1) = 1 != 8 GPUs")
    assert (d.span.line, d.span.column) == (12, 1)
