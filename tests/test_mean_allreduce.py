"""The fp32 mean is a wire format like the others: a Communicator, one per bucket, whose last
bucket carries every rank's header and whose check covers the whole mean."""

import math

import pytest
import torch
from distributed import run_ranks

from onebit.wire.mean import MeanAllreduce
from onebit.wire.protocol import Communicator, commit_compressed_

HEADER = 3


def _buckets(world_size, sizes=(5, 4), padding=3):
    """Communicators and one buffer laid out as the bucketer's: the buckets, the last padded,
    then the last bucket's header slots and the verdict value."""
    comms = [MeanAllreduce(sizes[0])]
    comms.append(MeanAllreduce(sizes[1], padded_numel=sizes[1] + padding, header_numel=HEADER))
    buffer = torch.zeros(sum(c.padded_numel for c in comms))
    views = [buffer[: comms[0].padded_numel], buffer[comms[0].padded_numel :]]
    assert comms[1].padded_numel == sizes[1] + padding + HEADER * world_size + 1
    return comms, buffer, views


def _mean_of_ranks(rank, world_size, bad_rank):
    comms, buffer, views = _buckets(world_size)
    n0, n1 = comms[0].numel, comms[1].numel
    buffer[:n0] = torch.arange(n0) + 10.0 * rank
    buffer[n0 : n0 + n1] = -(torch.arange(n1) + 10.0 * rank)
    if rank == bad_rank:
        buffer[1] = math.inf
    header = torch.full((HEADER,), float(rank + 1))
    calls = [comms[1].start(views[1], header), comms[0].start(views[0])]  # the last leaves first
    calls.reverse()
    headers, largest = MeanAllreduce.received(comms, calls)
    outputs = [torch.empty(n0), None]  # one copied out, one left in place
    commit_compressed_(comms, calls, outputs)
    return headers.clone(), float(largest), outputs[0], buffer[n0 : n0 + n1].clone()


@pytest.mark.parametrize("bad_rank", [None, 1])
def test_the_mean_gives_every_rank_each_ranks_header_and_a_check_of_the_whole_mean(bad_rank):
    results = run_ranks(_mean_of_ranks, 2, bad_rank, timeout=60)
    for headers, largest, first, second in results:
        assert torch.equal(headers, torch.tensor([[1.0] * HEADER, [2.0] * HEADER]))
        if bad_rank is None:
            assert torch.equal(first, torch.arange(5) + 5.0)  # (x + x + 10) / 2
            assert torch.equal(second, -(torch.arange(4) + 5.0))
            assert largest == 9.0  # the largest magnitude of both buckets' means
        else:
            assert math.isinf(largest)  # every rank sees the one non-finite value
    assert len({r[1] for r in results}) == 1


def test_the_mean_is_a_communicator_that_sends_the_slots_once_and_keeps_no_state():
    comms, buffer, views = _buckets(1)
    for comm in comms:
        assert isinstance(comm, Communicator) and not comm.batches
        assert comm.state_dict() == {}
    assert [c.bytes_per_call for c in comms] == [0, 0]  # one rank sends nothing
    assert MeanAllreduce(4, group=None).headers(comms[0].start(views[0])).numel() == 0
    with pytest.raises(ValueError, match="expected 5 values"):
        comms[0].start(buffer[:4])


def _bytes(rank, world_size):
    comms, _, _ = _buckets(world_size)
    return [c.bytes_per_call for c in comms]


def test_the_bytes_of_a_mean_count_the_header_slots_but_not_the_verdict():
    for sent in run_ranks(_bytes, 2, timeout=60):
        # a ring allreduce sends 2 (n-1)/n of the buffer: 5 values; 4 + 3 padding + 2 x 3 slots
        assert sent == [2 * 5 * 4 // 2, 2 * (4 + 3 + 2 * HEADER) * 4 // 2]
