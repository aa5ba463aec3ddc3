"""A sequence longer than a model's learned position table is refused at compile, in one line.

GPT-2 looks positions 0 .. s-1 up in `wpe` (n_positions rows), OPT positions
2 .. s+1 in a table of max_position_embeddings + 2 rows. At the longest
sequence the table holds both compile; one token more is refused naming the
table, its rows and the rows the sequence would read, at `train.seq_len`.
Token ids are looked up in a table too, but by value: they are not judged here.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import ptc
from ptc.compiler.capture import capture
from ptc.compiler.graph.position_tables import check_position_tables
from tests.user_models.transformers_models import SEQ, gpt2, llama, opt

warnings.filterwarnings("ignore", message=".*token_id.*")


def _captured(model, seq_len: int):
    return capture(model, micro_batch=2, seq_len=seq_len, dtype=torch.float32)


@pytest.mark.parametrize("factory,table,first", [
    (gpt2, "transformer.wpe.weight", 0), (opt, "model.decoder.embed_positions.weight", 2)])
def test_positions_past_the_table_are_refused(factory, table, first):
    model = factory()
    rows = dict(model.named_parameters())[table].shape[0]
    check_position_tables(_captured(model, SEQ), SEQ)  # the longest sequence it takes
    with pytest.raises(ptc.CompileError) as refused:
        check_position_tables(_captured(model, 2 * SEQ), 2 * SEQ)
    assert refused.value.field == "train.seq_len"
    assert str(refused.value) == (
        f"train.seq_len = {2 * SEQ}: the model looks positions up in {table}, a table of "
        f"{rows} rows, and a sequence of {2 * SEQ} tokens reads rows {first} to "
        f"{first + 2 * SEQ - 1}: the model takes at most {rows} positions (its "
        "max_position_embeddings); lower seq_len or give the model a longer table")


def test_compiling_a_plan_too_long_for_the_module_names_the_field():
    plan = ptc.Plan(model=ptc.ModelSpec(family="custom",
                                        factory="tests.user_models.transformers_models:gpt2"),
                    hardware=ptc.HardwareSpec.preset("cpu", gpus_per_node=1),
                    train=ptc.TrainSpec(seq_len=2 * SEQ, global_batch=2, micro_batch=2,
                                        dtype="fp32"))
    with pytest.raises(ptc.CompileError, match=r"^train.seq_len = 32: .*wpe[.]weight, a table "
                                               r"of 16 rows") as refused:
        ptc.compile(gpt2(), plan)
    assert refused.value.field == "train.seq_len"


def test_rotary_positions_and_token_ids_are_not_judged():
    # Llama has no position table; its token embedding reads ids, whatever the length.
    check_position_tables(_captured(llama(), 4 * SEQ), 4 * SEQ)
