"""FlatState shows flat buffers per parameter in optimizer.state and splits them per group."""

import gc
import weakref
from collections import defaultdict

import torch

from onebit.state.flat_state import FlatState
from onebit.state.layout import FlatLayout


def _flat_state():
    a, b, c = torch.zeros(2, 3), torch.zeros(4), torch.zeros(1, 5)
    groups = [{"params": [a, b], "lr": 1.0}, {"params": [c], "lr": 2.0}]
    layout = FlatLayout([a, b, c], bucket_size=8, world_size=2)
    return FlatState(layout, defaultdict(dict), groups, torch.device("cpu")), (a, b, c)


def test_a_named_buffer_is_each_parameters_view_in_state():
    flat, params = _flat_state()
    m = flat.zeros("exp_avg")
    padded = flat.zeros(padded=True)
    assert m.numel() == 15 and padded.numel() == flat.layout.padded_numel > 15
    m.copy_(torch.arange(15.0))
    views = [flat.state[p]["exp_avg"] for p in params]
    assert [v.shape for v in views] == [p.shape for p in params]
    assert torch.equal(torch.cat([v.reshape(-1) for v in views]), torch.arange(15.0))
    views[1].fill_(-1)  # a view, not a copy
    assert torch.equal(m[6:10], torch.full((4,), -1.0))
    flat.expose("frozen_denom", m)
    flat.expose("exp_avg", None)
    assert all(list(flat.state[p]) == ["frozen_denom"] for p in params)


def test_per_group_gives_each_group_its_parameters_and_views():
    flat, (a, b, c) = _flat_state()
    m, v = flat.zeros(), flat.zeros()
    m.copy_(torch.arange(15.0))
    groups = list(flat.per_group(m, v))
    assert [g["lr"] for g, *_ in groups] == [1.0, 2.0]
    (_, params0, ms0, vs0), (_, params1, ms1, _) = groups
    assert params0 == [a, b] and params1 == [c] and len(vs0) == 2
    assert torch.equal(ms1[0], torch.arange(10.0, 15.0).view(1, 5))


def test_bucket_params_lists_each_buckets_parameters_with_elements_in_it():
    sizes = [5, 0, 16, 3, 0, 40, 1]
    layout = FlatLayout([torch.zeros(n) for n in sizes], bucket_size=16, world_size=1)
    want = []
    for start, end in layout.buckets:
        spans = zip(layout.offsets, layout.numels)
        want.append([i for i, (o, n) in enumerate(spans) if max(start, o) < min(end, o + n)])
    assert layout.bucket_params == want
    assert want == [[0, 2], [2, 3, 5], [5], [5], [6]]  # empty tensors in none; 40 spans three


def test_a_buffers_views_are_made_once_and_go_with_the_buffer():
    """A step asks for the same buffers' views again and again: they are made once, for the
    buffer and any slice of it from its start, and freed with the buffer (a new buffer, which
    may reuse the memory, gets views of its own); new ones are made when the parameters change."""
    flat, (a, b, c) = _flat_state()
    layout = flat.layout
    m = flat.zeros(padded=True)
    views = layout.views(m)
    assert all(x is y for x, y in zip(views, layout.views(m)))
    assert all(x is y for x, y in zip(views, layout.views(m[: layout.numel])))
    assert [v.shape for v in views] == [a.shape, b.shape, c.shape]
    m[6:10] = 7.0
    assert torch.equal(views[1], torch.full((4,), 7.0))
    other = layout.views(m[1:16])  # another start: other views
    assert torch.equal(other[0].reshape(-1)[5:], torch.full((1,), 7.0))
    kept = weakref.ref(views[0])
    del m, views, other
    gc.collect()
    assert kept() is None
    fresh = torch.arange(15.0)
    assert torch.equal(layout.views(fresh)[2], torch.arange(10.0, 15.0).view(1, 5))
    layout.params[1] = torch.zeros(2, 2)  # a new local shard, as FSDP2 may give
    assert layout.views(fresh)[1].shape == (2, 2)
