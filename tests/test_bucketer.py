"""The bucketer gathers and launches buckets in a fixed order, through the optimizer's senders,
and overlaps backward."""

import gc
import weakref

import pytest
import torch
from distributed import run_ranks

from onebit.state.layout import FlatLayout
from onebit.transport.bucketer import Bucketer
from onebit.transport.engine import _CommSender, mean_communicators
from onebit.wire.comm import CompressedAllreduce
from onebit.wire.mean import MeanAllreduce, MeanCall

HEADER_NUMEL = 5


class Recorder:
    """The engine's side of its senders (``onebit.transport.engine``'s) and the step they open, with
    a bucketer of ``model``'s parameters, recording what the senders asked for."""

    def __init__(self, model, bucket_size=16, clip=False, overlap=False):
        self.layout = FlatLayout(list(model.parameters()), bucket_size, 1)
        self.comms = [
            CompressedAllreduce(e - s, segments=self.layout.segments(k), header_numel=HEADER_NUMEL)
            for k, (s, e) in enumerate(self.layout.buckets)
        ]
        self.means = mean_communicators(self.layout, HEADER_NUMEL, group=None, device="cpu")
        self.bucketer = Bucketer(self.layout, None, HEADER_NUMEL, clip=clip, overlap=overlap)
        self.inv_scale = None
        self.opened = self.closed = 0
        self.prepared = []
        self.headers = []

    def sender(self, kind):
        """What a ``kind`` call sends: ``"allreduce"`` (the fp32 mean) or ``"compressed"`` (1-bit,
        through ``prepare``, its headers carrying the buckets' norms)."""
        if kind == "allreduce":
            return _CommSender(self, self.means, True, None, False)
        return _CommSender(self, self.comms, True, self.prepare, True)

    @property
    def step(self):
        """The open step (this recorder), which each bucket sent asks for."""
        self.opened += 1
        return self

    def close(self):
        self.closed += 1

    def header_for(self, k, sparse=False, norm2=None):
        self.headers.append((k, sparse, None if norm2 is None else float(norm2)))
        return torch.full((HEADER_NUMEL,), float(k))

    def prepare(self, k, grads):
        self.prepared.append((k, grads.clone()))
        grads.mul_(2)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def _flat_grads(model, scale=1.0):
    grads = [
        torch.zeros(p.numel()) if p.grad is None else p.grad.reshape(-1) * scale
        for p in model.parameters()
    ]
    return torch.cat(grads)


def test_buckets_launch_last_first_each_gathered_unscaled_and_prepared():
    model = _model()
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    model[0].bias.grad = None  # counts as zero
    recorder = Recorder(model, clip=True)
    bucketer = recorder.bucketer
    buckets = bucketer.layout.buckets
    assert len(buckets) >= 3

    recorder.inv_scale = 0.5  # the open step's: a GradScaler's
    calls = bucketer.launch_all(recorder.sender("compressed"))

    assert [k for k, _ in recorder.prepared] == list(reversed(range(len(buckets))))
    want = _flat_grads(model, 0.5)
    for k, grads in recorder.prepared:
        start, end = buckets[k]
        assert torch.equal(grads, want[start:end])
        # what is sent is what prepare left in the buffer
        assert torch.equal(bucketer.grads[start:end], 2 * want[start:end])
    # the header carries each bucket's squared norm, taken before prepare
    for k, sparse, norm2 in recorder.headers:
        start, end = buckets[k]
        assert not sparse
        assert norm2 == pytest.approx(float(want[start:end].square().sum()), rel=1e-6)
    assert len(calls) == len(buckets) and bucketer.inflight == {}
    assert recorder.opened == len(buckets)


def test_fill_reports_a_sparse_gradient_and_unscales_low_precision_in_fp32():
    embedding = torch.nn.Embedding(6, 2, sparse=True)
    linear = torch.nn.Linear(2, 3).to(torch.bfloat16)
    model = torch.nn.ModuleList([embedding, linear])
    embedding(torch.tensor([1, 2])).sum().backward()
    linear.weight.grad = torch.full_like(linear.weight, 2.0**-120)  # underflows if scaled in bf16
    linear.bias.grad = torch.ones_like(linear.bias)
    bucketer = Recorder(model, bucket_size=1024).bucketer
    assert bucketer.fill(0, inv_scale=2.0**-10) == (True, None)  # no norm without clip
    n = embedding.weight.numel()
    assert torch.equal(bucketer.grads[:n], torch.zeros(n))
    weight = bucketer.grads[n : n + linear.weight.numel()]
    assert torch.equal(weight, torch.full_like(weight, 2.0**-130))


def _backward(model, seed=0):
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(seed))
    model(x).square().sum().backward()


def test_overlap_launches_every_bucket_during_backward_once_armed():
    model = _model()
    recorder = Recorder(model, overlap=True)
    bucketer = recorder.bucketer
    bucketer.sender = recorder.sender("allreduce")
    _backward(model)
    assert bucketer.inflight == {} and bucketer.backward_passes == 1  # not armed yet
    bucketer.armed = True
    model.zero_grad()
    with bucketer.no_sync():
        _backward(model)
    assert bucketer.inflight == {}
    _backward(model, seed=1)
    assert sorted(bucketer.inflight) == list(range(len(bucketer.layout.buckets)))
    assert all(isinstance(c, MeanCall) for c in bucketer.inflight.values())
    assert bucketer.backward_passes == 3
    # what was sent is the accumulated gradient of both backward passes
    calls = bucketer.launch_all(recorder.sender("allreduce"))
    assert len(calls) == len(bucketer.layout.buckets)
    n = bucketer.layout.numel
    assert torch.equal(bucketer.grads[:n], _flat_grads(model))


def _armed(kind):
    """A model and a bucketer that launches ``kind`` during backward (past its first step)."""
    model = _model()
    recorder = Recorder(model, overlap=True)
    bucketer = recorder.bucketer
    bucketer.sender = recorder.sender(kind)
    bucketer.armed = True
    return model, recorder, bucketer


def test_a_gradient_accumulated_after_its_bucket_left_abandons_the_step_and_raises():
    model, recorder, bucketer = _armed("compressed")
    _backward(model)
    assert bucketer.inflight
    with pytest.raises(RuntimeError, match="changed after its bucket was sent"):
        _backward(model)
    assert bucketer.inflight == {} and recorder.closed == 1


def test_a_gradient_edited_after_backward_is_found_and_refused_once_sent():
    model, recorder, bucketer = _armed("compressed")
    _backward(model)
    assert bucketer.edited_since_backward() == []  # nothing edited since
    assert bucketer.inflight and recorder.closed == 0
    bucketer.launch_all(recorder.sender("compressed"))
    model.zero_grad()
    _backward(model)
    model[0].weight.grad.mul_(0.5)  # as clip_grad_norm_ would, after the bucket left
    edited = bucketer.edited_since_backward()
    assert edited == [0] and bucketer.edited_since_backward() == []  # read once a backward
    with pytest.raises(RuntimeError, match="changed after backward"):
        bucketer.check_unsent(edited)
    assert bucketer.inflight == {} and recorder.closed == 1


def test_release_frees_the_buffer_and_the_next_use_makes_a_new_one():
    bucketer = Recorder(_model()).bucketer
    bucketer.grads.fill_(1.0)
    bucketer.release()
    assert bucketer._buffer is None
    assert bucketer.grads.numel() == bucketer.layout.padded_numel + HEADER_NUMEL + 1
    assert not bucketer.grads.any()
    assert bucketer.buckets[0].data_ptr() == bucketer.grads.data_ptr()


def test_the_hooks_do_not_keep_the_bucketer_alive():
    model = _model()
    recorder = Recorder(model, overlap=True)
    recorder.bucketer.sender = recorder.sender("allreduce")
    recorder.bucketer.armed = True
    ref = weakref.ref(recorder.bucketer)
    del recorder
    gc.collect()
    assert ref() is None
    _backward(model)  # the dead bucketer's hooks do nothing


def _allreduce_headers(rank, world_size):
    model = _model()
    for p in model.parameters():
        p.grad = torch.full_like(p, float(rank))
    recorder = Recorder(model)
    recorder.header_for = lambda k, sparse, norm2: torch.arange(HEADER_NUMEL) + 10.0 * rank
    bucketer = recorder.bucketer
    calls = bucketer.launch_all(recorder.sender("allreduce"))
    headers, largest = MeanAllreduce.received(recorder.means, calls)
    assert headers.data_ptr() == bucketer.header_slots().data_ptr()
    assert largest.data_ptr() == bucketer.verdict_slot().data_ptr()  # read with the headers
    n = bucketer.layout.numel
    return headers.clone(), float(largest), bucketer.grads[:n].clone()


def test_the_fp32_allreduce_gives_every_rank_every_ranks_header_and_the_mean():
    for slots, largest, mean in run_ranks(_allreduce_headers, 2, timeout=60):
        want = torch.stack([torch.arange(HEADER_NUMEL) + 10.0 * r for r in range(2)])
        assert torch.equal(slots, want)
        assert torch.equal(mean, torch.full_like(mean, 0.5))  # rank, averaged
        assert largest == 0.5
