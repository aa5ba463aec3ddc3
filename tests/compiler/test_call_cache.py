"""CallCache: a meta call is evaluated once per key, and only calls that are decided by
their key are cached (ptc.compiler.graph.call_cache)."""

import operator

import torch
from torch import fx, nn

from ptc.compiler.graph.call_cache import CallCache, module_signature, signature


def meta(*shape, dtype=torch.float32):
    return torch.empty(*shape, dtype=dtype, device="meta")


def graph_of(root: nn.Module) -> tuple[fx.Graph, fx.Node]:
    graph = fx.Graph(owning_module=root)
    return graph, graph.placeholder("x")


class Counted:
    """run() stand-in that counts the calls it makes."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args):
        self.calls += 1
        return self.fn(*args)


def test_same_signature_runs_once_and_gets_tensors_of_its_own():
    graph, x = graph_of(nn.Module())
    a = graph.call_function(torch.relu, (x,))
    b = graph.call_function(torch.relu, (x,))
    cache, run = CallCache(nn.Module()), Counted(torch.relu)
    first = cache.call(a, (meta(2, 3),), {}, lambda: run(meta(2, 3)))
    second = cache.call(b, (meta(2, 3),), {}, lambda: run(meta(2, 3)))
    assert run.calls == 1
    assert second is not first and second.shape == first.shape and second.dtype == first.dtype


def test_operands_that_differ_in_metadata_or_constants_miss():
    graph, x = graph_of(nn.Module())
    node = graph.call_function(operator.mul, (x, 2))
    cache = CallCache(nn.Module())
    keys = {cache.key(node, args, {}) for args in [
        (meta(2, 3), 2), (meta(3, 2), 2), (meta(2, 3, dtype=torch.bfloat16), 2),
        (meta(3, 2).t(), 2), (meta(2, 3), 2.0), (meta(2, 3), True)]}
    assert len(keys) == 6


def test_in_place_and_out_calls_are_never_cached():
    graph, x = graph_of(nn.Module())
    method = graph.call_method("unsqueeze_", (x, 0))
    function = graph.call_function(torch.add, (x, x))
    cache = CallCache(nn.Module())
    assert cache.key(method, (meta(2), 0), {}) is None
    assert cache.key(function, (meta(2), meta(2)), {"out": meta(2)}) is None
    assert cache.key(function, (meta(2), meta(2)), {}) is not None


def test_modules_key_by_class_configuration_and_parameters():
    root = nn.Module()
    root.a, root.b, root.c = nn.Linear(4, 8), nn.Linear(4, 8), nn.Linear(4, 16)
    root.d = nn.LayerNorm(4, eps=1e-3)
    root.e = nn.LayerNorm(4, eps=1e-5)
    root.to("meta")
    assert module_signature(root.a) == module_signature(root.b)
    assert module_signature(root.a) != module_signature(root.c)
    assert module_signature(root.d) != module_signature(root.e)
    graph, x = graph_of(root)
    cache = CallCache(root)
    keys = [cache.key(graph.call_module(name, (x,)), (meta(2, 4),), {}) for name in "abc"]
    assert keys[0] == keys[1] != keys[2]


def test_a_module_with_forward_hooks_is_not_cached():
    root = nn.Module()
    root.a = nn.Linear(4, 8, device="meta")
    root.a.register_forward_hook(lambda module, args, out: out)
    graph, x = graph_of(root)
    assert CallCache(root).key(graph.call_module("a", (x,)), (meta(2, 4),), {}) is None


def test_values_without_a_signature_are_not_cached():
    graph, x = graph_of(nn.Module())
    node = graph.call_function(operator.getitem, (x, 0))
    assert CallCache(nn.Module()).key(node, (object(), 0), {}) is None
    assert signature((1, 1.0, True)) != signature((1, 1, 1))


def test_graph_modules_key_by_structure_not_names():
    def region(names: tuple[str, str], scale: float) -> fx.GraphModule:
        graph = fx.Graph()
        x, w = (graph.placeholder(n) for n in names)
        y = graph.call_function(torch.mul, (graph.call_function(torch.matmul, (x, w)), scale))
        graph.output(y)
        return fx.GraphModule(nn.Module(), graph, "Region")

    layer0, layer1 = region(("x_0", "w_0"), 0.5), region(("x_1", "w_1"), 0.5)
    other = region(("x_0", "w_0"), 2.0)
    assert module_signature(layer0) == module_signature(layer1) != module_signature(other)
    assert signature((layer0, meta(2))) == signature((layer1, meta(2)))


def test_results_that_are_not_tensors_belong_to_their_call():
    graph, x = graph_of(nn.Module())
    a = graph.call_function(torch.relu, (x,))
    b = graph.call_function(torch.relu, (x,))
    cache, run = CallCache(nn.Module()), Counted(lambda: object())  # a handle, say
    first = cache.call(a, (meta(2),), {}, run)
    second = cache.call(b, (meta(2),), {}, run)
    assert run.calls == 2 and first is not second
