"""Parsing valid plans: the examples, every value form, and load_plan's file handling."""

from __future__ import annotations

from pathlib import Path

import pytest
from dsl_helpers import BASE, EXAMPLES, ROOT, edit, errors, find

from ptc.dsl import load_plan, parse
from ptc.errors import PlanError, PtcError
from ptc.plan import Plan

GiB = 2**30


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_parses_and_checks_clean(path: Path) -> None:
    plan = load_plan(path)
    assert isinstance(plan, Plan)
    assert plan.source == str(path)
    if "70b" in path.stem:
        assert plan.warnings == ()
        assert plan.num_gpus == 64
        parallel = plan.parallel
        assert parallel.tp * parallel.pp * parallel.dp == 64
    for section in (plan.model, plan.hardware, plan.parallel, plan.train):
        for span in section.spans.values():
            assert span.file == str(path) and span.line >= 1 and span.column >= 1
            assert span.source_line == path.read_text().split("\n")[span.line - 1]


def test_example_count() -> None:
    assert len(EXAMPLES) == 7


def test_example_values_are_in_base_units() -> None:
    plan = load_plan(ROOT / "examples" / "llama70b_h100x64_tp8_pp4_dp2.ptc")
    hw = plan.hardware
    assert hw.inter.bandwidth == 400e9 / 8 and hw.inter.latency == pytest.approx(5e-6)
    assert hw.intra.bandwidth == 450e9
    assert hw.hbm_bytes == 80 * GiB  # from the H100-SXM preset
    assert plan.parallel.schedule == "interleaved" and plan.parallel.virtual_stages == 2
    assert plan.train.optimizer.lr == 1.5e-4 and plan.train.optimizer.betas == (0.9, 0.95)
    assert plan.train.lr_schedule.kind == "cosine" and plan.train.lr_schedule.min_lr == 1.5e-5
    assert plan.runtime.nan_policy == "rollback"
    assert plan.model.rope_theta == 500000.0


def test_llama7b_example_shards_and_token_data() -> None:
    plan = load_plan(ROOT / "examples" / "llama7b_h100x8.ptc")
    assert [(r.pattern, r.style) for r in plan.parallel.shards] == [
        ("layers.*.mlp.gate", "colwise"), ("layers.*.mlp.up", "colwise"),
        ("layers.*.mlp.down", "rowwise")]
    assert plan.train.data.kind == "tokens" and plan.train.data.path == "/data/tokens.bin"
    assert plan.train.init.kind == "state_dict"
    assert plan.runtime.checkpoint_interval == 1800.0


def test_tiny_gpt_uses_cpu_preset() -> None:
    plan = load_plan(ROOT / "examples" / "tiny_gpt_cpu.ptc")
    assert plan.hardware.gpu == "cpu" and plan.model.tied_embeddings is True


# ------------------------------------------------------------ value forms


def test_numbers_units_and_separators() -> None:
    plan = parse(edit("global_batch = 16", "global_batch = 1_6",
                      "nodes = 1", "nodes = 1; hbm = 141 GB; mem_bandwidth = 4.8 TB/s",
                      "adamw(lr = 3e-4)", "adamw(lr = 1.5e-4, eps = 1E-8, weight_decay = 0)"))
    assert plan.train.global_batch == 16
    assert plan.hardware.hbm_bytes == 141e9 and plan.hardware.mem_bandwidth == 4.8e12
    assert plan.train.optimizer.eps == 1e-8 and plan.train.optimizer.weight_decay == 0.0


def test_one_line_sections_comments_crlf_and_bom() -> None:
    text = "\ufeff" + edit("model llama {", "model llama { # the model").replace("\n", "\r\n")
    plan = parse(text)
    assert plan.model.layers == 8
    compact = ('model gpt { layers = 2; hidden = 8; heads = 2; vocab = 16; max_seq = 8 }\n'
               'hardware { gpu = cpu; gpus_per_node = 1 }\n'
               'train { seq_len = 8; global_batch = 2 }')
    assert parse(compact).hardware.num_gpus == 1


def test_calls_may_span_lines() -> None:
    plan = parse(edit("adamw(lr = 3e-4)", "adamw(\n    lr = 3e-4,\n    betas = (0.8,\n"
                                          "      0.9),  # comment inside\n  )"))
    assert plan.train.optimizer.betas == (0.8, 0.9)


def test_auto_axes_and_optional_values() -> None:
    plan = parse(edit("dp = 2", "dp = auto", "steps = 10", "steps = 10\n  grad_clip = none",
                      "optimizer = adamw(lr = 3e-4)", "lr_schedule = constant"))
    assert plan.parallel.dp == "auto" and plan.train.grad_clip is None
    assert plan.train.lr_schedule.kind == "constant"


def test_per_layer_checkpoint_forms() -> None:
    ranges = parse(edit("checkpoint = selective",
                        "checkpoint = layers(full = [0..1, 6..7], selective = 2..4, none = 5)"))
    assert ranges.parallel.checkpoint == ("full", "full", "selective", "selective", "selective",
                                          "none", "full", "full")
    listed = parse(edit("checkpoint = selective", "checkpoint = [" + ", ".join(["full"] * 8) + "]"))
    assert listed.parallel.checkpoint == ("full",) * 8


def test_op_level_and_module_checkpoint_forms() -> None:
    """`ops` and `modules(...)`, whole, listed and by ranges; written canonically (the
    modules in core_attn, mlp, norm, act order; modules(core_attn) is selective)."""
    assert parse(edit("checkpoint = selective", "checkpoint = ops")).parallel.checkpoint == "ops"
    mods = parse(edit("checkpoint = selective", "checkpoint = modules(act, core_attn)"))
    assert mods.parallel.checkpoint == "modules(core_attn, act)"
    core = parse(edit("checkpoint = selective", "checkpoint = modules(core_attn)"))
    assert core.parallel.checkpoint == "selective"
    ranges = parse(edit("checkpoint = selective",
                        "checkpoint = layers(modules(mlp, norm) = 0..5, ops = [6, 7])"))
    assert ranges.parallel.checkpoint == ("modules(mlp, norm)",) * 6 + ("ops", "ops")
    listed = parse(edit("checkpoint = selective",
                        "checkpoint = [" + ", ".join(["modules(mlp)", "ops"] * 4) + "]"))
    assert listed.parallel.checkpoint == ("modules(mlp)", "ops") * 4
    from ptc.dsl import dump_plan  # noqa: PLC0415

    assert parse(dump_plan(ranges)).parallel.checkpoint == ranges.parallel.checkpoint


def test_unknown_recompute_module_names_the_valid_ones() -> None:
    (err,) = errors(edit("checkpoint = selective", "checkpoint = modules(core_attn, mpl)"))
    assert "unknown module 'mpl' in modules(...); did you mean 'mlp'?" in err.message
    assert err.choices == ("core_attn", "mlp", "norm", "act")
    assert (err.span.line, err.span.column) == (24, 35)
    (err,) = errors(edit("checkpoint = selective",
                         "checkpoint = layers(full = 0..3, modules(nrom) = 4..7)"))
    assert "unknown module 'nrom'" in err.message and err.choices[2] == "norm"
    (err,) = errors(edit("checkpoint = selective", "checkpoint = modules()"))
    assert "modules() names no module" in err.message


def test_auto_over_every_policy_parses_dumps_and_names_what_is_valid() -> None:
    """`auto(all)`: the compiler chooses among every policy; it dumps as written; anything
    else inside auto(...) is one error at its place with the valid form."""
    from ptc.dsl import dump_plan  # noqa: PLC0415

    plan = parse(edit("checkpoint = selective", "checkpoint = auto(all)"))
    assert plan.parallel.checkpoint == "auto(all)"
    assert "checkpoint = auto(all)" in dump_plan(plan)
    assert parse(dump_plan(plan)).parallel.checkpoint == "auto(all)"
    (err,) = errors(edit("checkpoint = selective", "checkpoint = auto(al)"))
    assert "auto(al) is not a choice of auto(...); did you mean 'all'?" in err.message
    assert err.choices == ("auto(all)",) and (err.span.line, err.span.column) == (24, 21)
    (err,) = errors(edit("checkpoint = selective", "checkpoint = auto(all, ops)"))
    assert "auto(...) takes one argument" in err.message and err.choices == ("auto(all)",)
    (err,) = errors(edit("checkpoint = selective", "checkpoint = auto()"))
    assert "auto(...) takes one argument" in err.message
    (err,) = errors(edit("checkpoint = selective", "checkpoint = auto(every = true)"))
    assert "auto(...) takes what to choose from" in err.message
    (err,) = errors(edit("checkpoint = selective", "checkpoint = [auto(all), full]"))
    assert err.choices  # per layer, a policy: auto is no layer's policy


def test_schedule_order_and_virtual_stages_key() -> None:
    plan = parse(edit("schedule = 1f1b", "schedule = interleaved\n  virtual_stages = 2",
                      "zero = 1", "zero = 1\n  order = (dp, tp, pp)"))
    assert plan.parallel.virtual_stages == 2 and plan.parallel.order == ("dp", "tp", "cp", "pp")  # cp just outside tp


def test_stage_boundaries_pin_pipeline_cuts() -> None:
    plan = parse(edit("zero = 1", 'zero = 1\n  stage_boundaries = ["layers.4"]'))
    assert plan.parallel.stage_boundaries == ("layers.4",)
    (err,) = errors(edit("zero = 1", 'zero = 1\n  stage_boundaries = ["layers.2", none]'))
    assert "stage_boundaries lists 2 cuts; pp(2) * virtual_stages(1) stages have 1" in err.message
    assert (err.span.line, err.span.column) == (23, 22)


def test_first_and_last_stage_layers_split_unevenly() -> None:
    from ptc.dsl import dump_plan

    text = edit("layers = 8", "layers = 9", "zero = 1", "zero = 1\n  first_stage_layers = 4")
    plan = parse(text)
    assert plan.parallel.first_stage_layers == 4 and plan.parallel.last_stage_layers is None
    assert plan.parallel.stage_layers(9) == (4, 5)
    assert parse(dump_plan(plan)) == plan
    (err,) = errors(edit("layers = 8", "layers = 9"))
    assert err.field == "parallel.pp" and "layers(9) is not divisible by pp(2)" in err.message
    (err,) = errors(edit("zero = 1", "zero = 1\n  first_stage_layers = 3\n"
                                     "  last_stage_layers = 4"))
    assert err.field == "parallel.first_stage_layers"
    assert err.message == ("first_stage_layers(3) + last_stage_layers(4) = 7 != layers(8): with "
                           "pp(2) the first and last rank hold every layer")
    assert (err.span.line, err.span.column) == (23, 24)


@pytest.mark.parametrize("gpu", ["B200", "V100-SXM2-32GB", "H200", "GB200", "GB300"])
def test_new_presets_parse(gpu: str) -> None:
    dtype = "fp16" if gpu.startswith("V100") else "bf16"
    plan = parse(edit('gpu = "H100-SXM"', f'gpu = "{gpu}"', "dtype = bf16", f"dtype = {dtype}"))
    assert plan.hardware.gpu == gpu and dtype in plan.hardware.peak_flops


def test_an_nvl72_preset_is_one_72_gpu_nvlink_domain() -> None:
    """GB200 / GB300 racks: 72 GPUs on one NVLink domain unless the plan says fewer."""
    (err,) = errors(edit('gpu = "H100-SXM"', 'gpu = "GB200"', "  gpus_per_node = 8\n", ""))
    assert err.field == "parallel.tp"
    assert "!= 72 GPUs (nodes(1) * gpus_per_node(72))" in err.message
    plan = parse(edit('gpu = "H100-SXM"', 'gpu = "GB300"'))
    assert plan.hardware.intra.bandwidth == 900e9 and plan.hardware.inter.bandwidth == 100e9


def test_bf16_on_v100_is_refused() -> None:
    (err,) = errors(edit('gpu = "H100-SXM"', 'gpu = "V100-SXM2-32GB"'))
    assert err.field == "train.dtype"
    assert err.message == "train dtype bf16 has no peak in hardware V100-SXM2-32GB"


def test_preset_fields_can_be_overridden() -> None:
    plan = parse(edit("nodes = 1", "nodes = 1\n  hbm = 94 GB\n  peak = flops(bf16 = 900 TFLOP/s)"
                                   "\n  achievable_fraction = 0.4\n  nvlink_sharp = false"
                                   "\n  attention_fraction = 0.3"))
    hw = plan.hardware
    assert hw.gpu == "H100-SXM" and hw.hbm_bytes == 94e9 and hw.peak_flops == {"bf16": 900e12}
    assert hw.achievable_fraction == 0.4 and hw.nvlink_sharp is False
    assert hw.attention_fraction == 0.3
    assert hw.mem_bandwidth == 3350e9  # untouched preset figure


def test_a_share_of_peak_above_one_is_refused_at_its_line() -> None:
    (err,) = errors(edit("nodes = 1", "nodes = 1\n  attention_fraction = 1.5"))
    assert err.field == "hardware.attention_fraction" and err.span is not None
    assert err.message == "attention_fraction is a share of peak (0, 1], got 1.5"


def test_custom_model_items_become_factory_kwargs() -> None:
    text = edit(BASE[:BASE.index("hardware {")],
                'model "my_pkg.models:build" {\n  width = 64; act = gelu; name = "x\\ty"\n'
                '  sizes = (1, 2.5); flags = [true, false, none]; budget = 1 KiB\n}\n\n')
    plan = parse(text)
    assert plan.model.family == "custom" and plan.model.factory == "my_pkg.models:build"
    assert dict(plan.model.kwargs) == {"width": 64, "act": "gelu", "name": "x\ty",
                                       "sizes": (1, 2.5), "flags": [True, False, None],
                                       "budget": 1024.0}


def test_string_escapes() -> None:
    plan = parse(edit('checkpoint_dir = "ckpt"', r'checkpoint_dir = "C:\data \"q\" \u00e9\\"'))
    assert plan.runtime.checkpoint_dir == 'C:\\data "q" é\\'


def test_diagnostic_render_has_location_caret_and_choices() -> None:
    d = find(errors(edit("dtype = bf16", "dtype = bf61")), "dtype")
    assert d.render() == ("plan.ptc:31:11: error: dtype = bf61 is not a valid choice"
                          "; did you mean 'bf16'? [train.dtype]\n"
                          "      dtype = bf61\n"
                          "              ^^^^\n"
                          "    valid: fp32, bf16, fp16, fp8")


# -------------------------------------------------------------- load_plan


def test_load_plan_missing_file(tmp_path: Path) -> None:
    with pytest.raises(PtcError, match="cannot read plan file .*nope.ptc"):
        load_plan(tmp_path / "nope.ptc")


def test_load_plan_directory(tmp_path: Path) -> None:
    with pytest.raises(PtcError, match="cannot read plan file"):
        load_plan(tmp_path)


def test_load_plan_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "latin1.ptc"
    path.write_bytes(BASE.replace("golden", "gold\xe9n").encode("latin-1"))
    with pytest.raises(PtcError, match="is not UTF-8 text"):
        load_plan(path)


def test_load_plan_errors_name_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.ptc"
    path.write_text(edit("zero = 1", "zero = 9"))
    with pytest.raises(PlanError) as info:
        load_plan(path)
    assert info.value.diagnostics[0].span.file == str(path)
    assert str(info.value).startswith(f"{path}:22:10: error: zero must be a stage 0-3")


def test_parse_rejects_non_text() -> None:
    with pytest.raises(PtcError):
        parse(b"model gpt {}")  # type: ignore[arg-type]


def test_internal_errors_still_come_out_as_plan_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    import ptc.dsl as dsl

    def broken(tree, source):
        raise KeyError("boom")

    monkeypatch.setattr(dsl, "build_plan", broken)
    with pytest.raises(PlanError, match="internal error while checking the plan: KeyError"):
        dsl.parse(BASE)


def test_a_warmup_the_run_never_finishes_is_a_warning_at_its_place() -> None:
    text = edit("  steps = 10", "  steps = 10\n  lr_schedule = cosine(warmup = 40)")
    (warning,) = parse(text, "plan.ptc").warnings
    assert warning.severity == "warning" and warning.field == "train.lr_schedule.warmup"
    assert warning.message == ("warmup(40) >= steps(10): the run ends while the learning rate "
                               "still warms up, at 25% of lr")
    line = text.splitlines().index("  lr_schedule = cosine(warmup = 40)") + 1
    assert (warning.span.line, warning.span.column) == (line, 33)
    assert parse(edit("  steps = 10", "  steps = 10\n  lr_schedule = cosine(warmup = 9)"),
                 "plan.ptc").warnings == ()
