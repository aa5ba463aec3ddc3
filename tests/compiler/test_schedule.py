"""The pipeline schedule IR: text forms, generation, lowering, simulation and golden grids.

Golden grids live in tests/compiler/golden/schedule_<kind>_p<p>_m<m>_v<v>.txt;
`PTC_UPDATE_GOLDEN=1 pytest tests/compiler/test_schedule.py` rewrites them
(review the diff: a grid change is a schedule change).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # plain `pytest` does not put the repo root on the path
    sys.path.insert(0, str(ROOT))

from ptc.compiler.records.layout import layout_of  # noqa: E402
from ptc.compiler.memory.model import in_flight  # noqa: E402
from ptc.compiler.schedule.actions import (COMM, KINDS, Action, Schedule, ScheduleError,
                                           format_schedule)
from ptc.compiler.schedule.build import build_schedule, parse_schedule
from ptc.views.schedule_grid import format_grid, render_schedule
from ptc.compiler.schedule.lowering import per_rank_actions, needed_receive
from ptc.compiler.schedule.simulation import simulate
from ptc.errors import PlanError  # noqa: E402
from ptc.plan import HardwareSpec, ModelSpec, ParallelSpec, Plan, TrainSpec  # noqa: E402

pytestmark = pytest.mark.timeout(60)

GOLDEN = Path(__file__).parent / "golden"
GOLDEN_CASES = [("gpipe", 4, 4, 1), ("1f1b", 2, 4, 1), ("1f1b", 4, 4, 1), ("1f1b", 4, 8, 1),
                ("interleaved", 2, 4, 2), ("interleaved", 4, 4, 2), ("interleaved", 4, 8, 2),
                ("interleaved", 2, 4, 3), ("zero_bubble", 2, 4, 1), ("zero_bubble", 4, 8, 1),
                ("zero_bubble", 2, 4, 2), ("zbv", 2, 4, 2), ("zbv", 4, 8, 2),
                ("dualpipev", 2, 4, 2), ("dualpipev", 4, 8, 2)]
GRID = [(kind, p, m, v) for kind in ("gpipe", "1f1b", "zero_bubble") for p in (2, 3, 4, 8)
        for m in (p, p + 1, 2 * p, 3 * p + 1) for v in (1,)] + \
       [(kind, p, m, v) for kind in ("interleaved", "zero_bubble") for p in (2, 3, 4)
        for m in (p, 2 * p, 3 * p) for v in (2, 3, 4)] + \
       [("zbv", p, m, 2) for p in (2, 3, 4, 5, 8) for m in (1, p - 1, p, p + 1, 2 * p, 3 * p + 1)] + \
       [("dualpipev", p, m, 2) for p in (2, 3, 4, 5, 8) for m in (2 * p, 2 * p + 1, 3 * p + 1)]
SPLIT = ("zero_bubble", "zbv", "dualpipev")


def plan(kind: str, p: int, m: int, v: int) -> Plan:
    """A plan whose pipeline is (kind, p, m, v): one sample per micro-batch, dp = 1."""
    return Plan(model=ModelSpec(family="gpt", layers=p * v * 2, hidden=32, heads=4, vocab=64,
                                max_seq=16),
                hardware=HardwareSpec.preset("cpu", gpus_per_node=p),
                parallel=ParallelSpec(pp=p, schedule=kind, virtual_stages=v),
                train=TrainSpec(seq_len=16, global_batch=m, micro_batch=1, dtype="fp32"))


class TestActionText:
    @pytest.mark.parametrize("kind", KINDS)
    def test_prints_and_parses_back(self, kind: str) -> None:
        action = Action(12, kind, 3)
        assert str(action) == f"12{kind}3"
        assert Action.parse(str(action)) == action

    def test_reads_torch_style_text(self) -> None:
        assert Action.parse("1F0") == Action(1, "F", 0)
        assert Action.parse(" 0SEND_B2 ") == Action(0, "SEND_B", 2)

    @pytest.mark.parametrize("text", ["F0", "1X0", "1F", "1 F 0", "-1F0", "1SEND0"])
    def test_rejects_what_is_not_an_action(self, text: str) -> None:
        with pytest.raises(ScheduleError, match="is not an action"):
            Action.parse(text)


class TestScheduleText:
    @pytest.mark.parametrize("kind,p,m,v", GOLDEN_CASES)
    def test_round_trips_through_parse(self, kind: str, p: int, m: int, v: int) -> None:
        schedule = build_schedule(kind, p, m, v)
        text = format_schedule(schedule)
        assert text.splitlines()[0] == f"schedule {kind} pp={p} v={v} m={m}"
        assert parse_schedule(text) == schedule

    def test_parse_names_a_bad_line(self) -> None:
        with pytest.raises(ScheduleError, match=r'line 3: expected "rank 1: \.\.\."'):
            parse_schedule("schedule 1f1b pp=2 v=1 m=1\nrank 0: 0F0 0B0\nrank 2: 1F0 1B0\n")
        with pytest.raises(ScheduleError, match="starts with"):
            parse_schedule("rank 0: 0F0")


class TestGeneration:
    def test_1f1b_warms_up_then_alternates(self) -> None:
        schedule = build_schedule("1f1b", 4, 8)
        assert " ".join(map(str, schedule.ranks[1])) == \
            "1F0 1F1 1F2 1B0 1F3 1B1 1F4 1B2 1F5 1B3 1F6 1B4 1F7 1B5 1B6 1B7"
        assert " ".join(map(str, schedule.ranks[3])).startswith("3F0 3B0 3F1 3B1")

    def test_gpipe_runs_every_forward_first(self) -> None:
        schedule = build_schedule("gpipe", 2, 3)
        assert [str(a) for a in schedule.ranks[0]] == ["0F0", "0F1", "0F2", "0B0", "0B1", "0B2"]

    def test_interleaved_places_stage_s_on_rank_s_mod_p(self) -> None:
        schedule = build_schedule("interleaved", 4, 8, 2)
        for rank, actions in enumerate(schedule.ranks):
            assert {a.stage for a in actions} == {rank, rank + 4}
        assert schedule.stages_of(1) == (1, 5) and schedule.rank_of(6) == 2

    @pytest.mark.parametrize("kind,p,m,v", GRID)
    def test_every_schedule_is_deadlock_free_and_complete(self, kind: str, p: int, m: int,
                                                          v: int) -> None:
        timeline = simulate(build_schedule(kind, p, m, v))
        done = [a for row in timeline.steps for a in row if a is not None]
        assert len(done) == len(set(done))
        ended = sorted((a.stage, a.microbatch) for a in done if a.kind in ("B", "W"))
        assert ended == [(s, i) for s in range(p * v) for i in range(m)]
        assert len(done) == (3 if kind in ("zero_bubble", "zbv") else 2) * p * v * m \
            or kind == "dualpipev"  # DualPipeV splits only its last backwards

    @pytest.mark.parametrize("kind,p,m,v", GRID)
    def test_peak_in_flight_is_what_the_memory_model_charges(self, kind: str, p: int, m: int,
                                                             v: int) -> None:
        """The simulated peak per rank equals `memory.in_flight`'s units, rank by rank."""
        timeline = simulate(build_schedule(kind, p, m, v))
        layout = layout_of(plan(kind, p, m, v))
        assert timeline.peak_in_flight == tuple(in_flight(layout, r, m)[0] for r in range(p))


class TestZeroBubble:
    """ZB-H1: each backward split into I and W, the Ws filling 1F1B's bubble."""

    def test_every_backward_is_split_and_w_follows_its_i(self) -> None:
        schedule = build_schedule("zero_bubble", 4, 8)
        for actions in schedule.ranks:
            kinds = [a.kind for a in actions]
            assert "B" not in kinds and kinds.count("I") == kinds.count("W") == 8
            for a in actions:
                if a.kind == "W":
                    assert actions.index(Action(a.stage, "I", a.microbatch)) < actions.index(a)

    @pytest.mark.parametrize("p,m,v", [(2, 4, 1), (3, 6, 1), (4, 8, 1), (4, 16, 1), (8, 8, 1),
                                       (8, 24, 1), (2, 4, 2), (4, 8, 2), (3, 6, 3)])
    def test_the_bubble_is_a_third_of_1f1bs(self, p: int, m: int, v: int) -> None:
        """In unit-time actions (F = I = W = 1, 1F1B's B = I + W = 2) 1F1B's step takes
        3m + 3(p - 1) units; ZB-H1's takes 3m + (p - 1) (Qi et al. 2024, section 3), and on
        interleaved 1F1B's order with v chunks 3mv + (p - 1)."""
        timeline = simulate(build_schedule("zero_bubble", p, m, v))
        assert len(timeline.steps) == 3 * m * v + (p - 1)

    def test_no_rank_holds_more_than_1f1bs_first_rank(self) -> None:
        """Activations stay until W: every rank holds at most p micro-batches, as 1F1B's
        first rank does, so the job's peak activation memory is 1F1B's."""
        for p, m in ((2, 4), (4, 8), (4, 16), (8, 8)):
            assert simulate(build_schedule("zero_bubble", p, m)).peak_in_flight == (p,) * p

    def test_stage_peaks_are_what_the_memory_model_charges_the_ends(self) -> None:
        """The embedding's activations (stage 0) and the loss's (the last stage) are charged
        for as many micro-batches as those stages hold at once."""
        from ptc.compiler.memory.model import _first_chunk_units
        for kind, p, m, v in [("zbv", 4, 8, 2), ("zbv", 2, 3, 2), ("zbv", 8, 9, 2),
                              ("zero_bubble", 4, 8, 2), ("zero_bubble", 2, 4, 2)]:
            layout = layout_of(plan(kind, p, m, v))
            peaks = simulate(build_schedule(kind, p, m, v)).stage_peak_in_flight
            assert _first_chunk_units(layout, None, m, min) == peaks[0], (kind, p, m, v)

    def test_text_names_i_and_w(self) -> None:
        assert Action.parse("3I7") == Action(3, "I", 7)
        assert str(Action(0, "W", 2)) == "0W2"


class TestZBV:
    """ZB-V: two chunks per rank in a V, each backward split into I and W."""

    def test_rank_r_holds_stages_r_and_2p_minus_1_minus_r(self) -> None:
        schedule = build_schedule("zbv", 4, 8, 2)
        for rank, actions in enumerate(schedule.ranks):
            assert {a.stage for a in actions} == {rank, 7 - rank}
        assert schedule.stages_of(0) == (0, 7) and schedule.rank_of(4) == 3

    def test_the_middle_hand_over_sends_nothing(self) -> None:
        """Stages p - 1 and p share the last rank: no message between them."""
        for program in per_rank_actions(build_schedule("zbv", 4, 8, 2)):
            assert not [a for a in program if (a.kind, a.stage) in
                        (("SEND_F", 3), ("RECV_F", 4), ("SEND_B", 4), ("RECV_B", 3))]

    @pytest.mark.parametrize("p", [2, 3, 4, 8])
    def test_the_bubble_is_p_minus_1_half_stage_units(self, p: int) -> None:
        """Unit-time half-stage actions: 6m units of work per rank and p - 1 of bubble,
        half ZB-H1's (p - 1 whole-stage units) at 1F1B's activation memory (2p half-stage
        micro-batches per rank)."""
        for m in (2 * p, 2 * p + 1, 3 * p, 4 * p):
            timeline = simulate(build_schedule("zbv", p, m, 2))
            assert len(timeline.steps) == 6 * m + p - 1, m
            assert timeline.peak_in_flight == (2 * p,) * p

    def test_any_number_of_microbatches_runs(self) -> None:
        for m in (1, 2, 3, 5):
            assert simulate(build_schedule("zbv", 4, m, 2)).peak_in_flight == (2 * m,) * 4 \
                if m < 4 else True

    @pytest.mark.parametrize("v", [1, 3])
    def test_other_virtual_stages_are_refused(self, v: int) -> None:
        with pytest.raises(ScheduleError, match=f"needs virtual_stages = 2, got {v}"):
            build_schedule("zbv", 2, 4, v)


def timed_step(schedule: Schedule, seconds: dict[str, float]) -> float:
    """When the last rank finishes `schedule`'s lowered programs when each compute kind takes
    `seconds[kind]` and messages arrive as they are sent: each rank runs its actions in
    order, a compute starting once its rank is free and what it reads has been made."""
    programs, n = per_rank_actions(schedule), schedule.num_stages
    clock, pc, made = [0.0] * schedule.pp, [0] * schedule.pp, {}
    moved = True
    while moved:
        moved = False
        for r, program in enumerate(programs):
            while pc[r] < len(program):
                action, start = program[pc[r]], clock[r]
                needed = needed_receive(action, n)
                if needed is not None:  # what it reads: the neighbouring stage's compute
                    key = (needed[1], "F" if action.kind == "F" else "back", action.microbatch)
                    if key not in made:
                        break
                    start = max(start, made[key])
                if action.kind in seconds:
                    clock[r] = start + seconds[action.kind]
                    back = "F" if action.kind == "F" else "back"
                    if action.kind != "W":
                        made[action.stage, back, action.microbatch] = clock[r]
                pc[r] += 1
                moved = True
    assert pc == [len(program) for program in programs]
    return max(clock)


class TestDualPipeV:
    """DualPipeV: two chunks in a V, forward and backward of two micro-batches side by side."""

    @pytest.mark.parametrize("p,m", [(2, 4), (3, 6), (4, 8), (4, 9), (8, 16), (8, 24)])
    def test_holds_2p_plus_1_chunk_microbatches_per_rank(self, p: int, m: int) -> None:
        assert simulate(build_schedule("dualpipev", p, m, 2)).peak_in_flight == (2 * p + 1,) * p

    def test_pairs_a_forward_with_another_micro_batchs_backward(self) -> None:
        actions = build_schedule("dualpipev", 4, 12, 2).ranks[1]
        pairs = [(a, b) for a, b in zip(actions, actions[1:]) if a.kind == "F" and b.kind == "B"]
        assert len(pairs) >= 12 and all(a.microbatch != b.microbatch for a, b in pairs)

    @pytest.mark.parametrize("p", [2, 3, 4, 8])
    def test_a_split_backward_leaves_p_minus_1_chunk_units_idle(self, p: int) -> None:
        """Timed with F = I = W = 1 and B = I + W = 2 (chunk units): DualPipeV, ZB-V and
        zero bubble on two chunks take 6m + p - 1, interleaved 1F1B 6m + 3(p - 1). The cost
        model's (p - 1)/v · (F + I - W) and (p - 1)/v · (F + B) say the same."""
        seconds = {"F": 1.0, "I": 1.0, "W": 1.0, "B": 2.0}
        for m in (2 * p, 3 * p, 4 * p):
            for kind in ("dualpipev", "zbv", "zero_bubble"):
                assert timed_step(build_schedule(kind, p, m, 2), seconds) == 6 * m + p - 1
            assert timed_step(build_schedule("interleaved", p, m, 2), seconds) == \
                6 * m + 3 * (p - 1)

    def test_fewer_micro_batches_than_stages_are_refused(self) -> None:
        with pytest.raises(ScheduleError, match="schedule dualpipev with pp = 4 needs at least "
                                                "8 micro-batches .*one in flight per stage"):
            build_schedule("dualpipev", 4, 7, 2)
        with pytest.raises(PlanError, match=r"schedule dualpipev needs at least 2 \* pp\(2\) = "
                                            r"4 micro-batches, one per stage, got 3"):
            plan("dualpipev", 2, 3, 2)


class TestMicrobatchRequirement:
    @pytest.mark.parametrize("kind,v", [("1f1b", 1), ("interleaved", 2)])
    def test_too_few_microbatches_is_a_clear_error(self, kind: str, v: int) -> None:
        with pytest.raises(ScheduleError, match=rf"schedule {kind} with pp = 4 needs at least 4 "
                                                rf"micro-batches per step .*got 3"):
            build_schedule(kind, 4, 3, v)

    def test_interleaved_needs_groups_of_p(self) -> None:
        with pytest.raises(ScheduleError, match="micro-batches = 6 is not divisible by 4"):
            build_schedule("interleaved", 4, 6, 2)

    def test_gpipe_runs_with_one(self) -> None:
        assert len(simulate(build_schedule("gpipe", 4, 1)).steps) == 8

    def test_a_plan_with_too_few_is_rejected_before_compiling(self) -> None:
        with pytest.raises(PlanError, match=r"schedule 1f1b needs at least pp\(4\) micro-batches, "
                                            r"got 2"):
            plan("1f1b", 4, 2, 1)


class TestLowering:
    @pytest.mark.parametrize("kind,p,m,v", GOLDEN_CASES)
    def test_receives_come_before_their_compute_and_sends_right_after(
            self, kind: str, p: int, m: int, v: int) -> None:
        schedule = build_schedule(kind, p, m, v)
        for rank, program in enumerate(per_rank_actions(schedule)):
            assert [a for a in program if a.kind not in COMM] == list(schedule.ranks[rank])
            for i, action in enumerate(program):
                needed = needed_receive(action, schedule.num_stages)
                if needed is not None and schedule.rank_of(needed[1]) != rank:
                    assert needed[0] in program[:i], f"rank {rank}: {action} before {needed[0]}"
                if action.kind in ("SEND_F", "SEND_B"):  # a split backward's I sends, not W
                    made = program[i - 1]
                    assert (made.stage, made.microbatch) == (action.stage, action.microbatch)
                    assert made.kind == "F" if action.kind == "SEND_F" else \
                        made.kind in (("I", "B") if kind == "dualpipev" else
                                      ("I",) if kind in SPLIT else ("B",))

    def test_receives_are_posted_one_compute_ahead(self) -> None:
        program = per_rank_actions(build_schedule("1f1b", 2, 2))[1]
        assert [str(a) for a in program] == [
            "1RECV_F0", "1F0", "1RECV_F1", "1B0", "1SEND_B0", "1F1", "1B1", "1SEND_B1"]


class TestSimulationFailures:
    def test_deadlock_names_what_each_rank_waits_for(self) -> None:
        # Rank 1 wants micro-batch 1 before it returns micro-batch 0's gradient; rank 0 sends
        # micro-batch 1 only after that gradient.
        text = "schedule custom pp=2 v=1 m=2\nrank 0: 0F0 0B0 0F1 0B1\nrank 1: 1F0 1F1 1B0 1B1\n"
        with pytest.raises(ScheduleError, match=r"deadlocks at step 2: rank 0 waits in 0B0 for "
                                                r"1SEND_B0 from rank 1; rank 1 waits in 1F1 for "
                                                r"0SEND_F1 from rank 0"):
            parse_schedule(text)

    def test_receives_follow_the_senders_order_whatever_the_consumers(self) -> None:
        # Rank 1 consumes micro-batch 1 first; rank 0 sends micro-batch 0 first. Messages are
        # matched in posting order, so rank 1 must post micro-batch 0's receive first.
        schedule = Schedule(kind="custom", pp=2, virtual=1, microbatches=2, ranks=(
            tuple(map(Action.parse, "0F0 0F1 0B0 0B1".split())),
            tuple(map(Action.parse, "1F1 1B1 1F0 1B0".split()))))
        assert [str(a) for a in per_rank_actions(schedule)[1][:3]] == ["1RECV_F0", "1RECV_F1", "1F1"]
        assert [str(a) for a in per_rank_actions(schedule)[0] if a.kind == "RECV_B"] == ["0RECV_B1",
                                                                              "0RECV_B0"]
        assert len(simulate(schedule).steps) == 8

    @pytest.mark.parametrize("ranks,needle", [
        (("0F0 0B0", "1F0"), r"rank 1 never runs 1B0"),
        (("0F0 0B0 1F0 1B0", ""), r"rank 0: 1F0 belongs to rank 1"),
        (("0B0 0F0", "1F0 1B0"), r"rank 0: 0B0 comes before 0F0"),
        (("0F0 0F0 0B0", "1F0 1B0"), r"rank 0: 0F0 appears twice"),
        (("0F0 0SEND_F0 0B0", "1F0 1B0"), r"per_rank_actions\(\) adds the sends"),
        (("0F0 0W0 0I0", "1F0 1I0 1W0"), r"rank 0: 0W0 comes before 0I0"),
        (("0F0 0I0 0W0 0B0", "1F0 1B0"),
         r"rank 0: 0B0 after 0I0: a micro-batch's backward is either B, or I then W"),
        (("0F0 0I0", "1F0 1I0 1W0"), r"rank 0 never runs 0W0"),
    ])
    def test_malformed_schedules_are_named(self, ranks: tuple[str, str], needle: str) -> None:
        schedule = Schedule(kind="custom", pp=2, virtual=1, microbatches=1, ranks=tuple(
            tuple(map(Action.parse, r.split())) for r in ranks))
        with pytest.raises(ScheduleError, match=needle):
            simulate(schedule)


class TestGrid:
    @pytest.mark.parametrize("kind,p,m,v", GOLDEN_CASES)
    def test_golden_grid(self, kind: str, p: int, m: int, v: int) -> None:
        grid = format_grid(build_schedule(kind, p, m, v))
        path = GOLDEN / f"schedule_{kind}_p{p}_m{m}_v{v}.txt"
        if os.environ.get("PTC_UPDATE_GOLDEN"):
            path.parent.mkdir(exist_ok=True)
            path.write_text(grid)
        assert grid == path.read_text(), f"{path.name} differs; rerun with PTC_UPDATE_GOLDEN=1 " \
                                         f"if the schedule change is intended"

    def test_render_schedule_of_a_plan(self) -> None:
        text = render_schedule(plan("1f1b", 2, 4, 1))
        assert text.splitlines()[0] == "1f1b schedule: pp=2 v=1 m=4, 2 stages on 2 ranks"
        assert text.splitlines()[-1] == "10 steps, bubble 20%, peak in flight per rank: 2 1"

    def test_steps_and_ranks_narrow_the_grid_but_not_its_summary(self) -> None:
        whole = render_schedule(plan("1f1b", 2, 4, 1)).splitlines()
        part = render_schedule(plan("1f1b", 2, 4, 1), steps="3:5", ranks="1").splitlines()
        assert part[0] == whole[0] and part[-1] == whole[-1]
        assert part[1] == "step  rank 1"
        rank1 = [line[6:].split()[1] for line in whole[5:7]]  # steps 3 and 4, rank 1's column
        assert [line.split()[1] for line in part[2:-1]] == rank1
        assert [int(line.split()[0]) for line in part[2:-1]] == [3, 4]

    @pytest.mark.parametrize("steps,ranks,message", [
        ("20:", None, r"--steps '20:': give N, A:B or A,B,C with numbers 0 \.\. 9"),
        (None, "2", r"--ranks '2': give N, A:B or A,B,C with numbers 0 \.\. 1"),
        ("a", None, r"--steps 'a'")])
    def test_a_selection_outside_the_grid_is_refused(self, steps, ranks, message) -> None:
        with pytest.raises(ValueError, match=message):
            render_schedule(plan("1f1b", 2, 4, 1), steps=steps, ranks=ranks)

    def test_render_schedule_without_pipeline(self) -> None:
        assert render_schedule(plan("1f1b", 1, 4, 1)).startswith("pp = 1: no pipeline schedule")
