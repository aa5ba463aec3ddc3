"""NodeInfo is frozen, written once, changed by replace, and copied to created nodes."""

import dataclasses

import pytest
import torch
from torch import fx

from ptc.compiler.records.graph_meta import NodeInfo
from ptc.compiler.graph.meta import copy_meta, get_info, info, set_info, update_info


def record(**kw):
    base = dict(module_path="layers.3.attn.q", module_type="Linear", layer=3, kind="linear",
                shapes=((2, 16, 64),), dtypes=(torch.bfloat16,), flops=10, params=4, param_bytes=8,
                source="model.py:12")
    base.update(kw)
    return NodeInfo(**base)


def two_nodes():
    graph = fx.Graph()
    x = graph.placeholder("x")
    return graph.call_function(torch.relu, (x,)), graph.call_function(torch.neg, (x,))


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        record().flops = 3


def test_out_bytes():
    assert record(shapes=((2, 3), (4,)), dtypes=(torch.bfloat16, torch.float32)).out_bytes == 28


def test_update_replaces_the_record():
    node, _ = two_nodes()
    first = record()
    set_info(node, first)
    new = update_info(node, flops=99)
    assert info(node) is new and new.flops == 99 and first.flops == 10


def test_copy_meta_carries_provenance_and_changes():
    src, dst = two_nodes()
    set_info(src, record())
    src.meta["nn_module_stack"] = {"layers.3": ("layers.3", object)}
    src.meta["stack_trace"] = 'File "model.py", line 12, in forward'
    copy_meta(src, dst, kind="other", flops=0)
    assert (info(dst).module_path, info(dst).layer, info(dst).kind, info(dst).flops) == \
        ("layers.3.attn.q", 3, "other", 0)
    assert info(src).kind == "linear"
    assert dst.meta["nn_module_stack"] == src.meta["nn_module_stack"]
    assert dst.meta["nn_module_stack"] is not src.meta["nn_module_stack"]
    assert dst.meta["stack_trace"] == src.meta["stack_trace"]


def test_missing_info():
    node, _ = two_nodes()
    assert get_info(node) is None
    with pytest.raises(KeyError, match="copy_meta"):
        info(node)
