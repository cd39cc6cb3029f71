"""Communication accounting: what each optimizer step handed to collectives, in bytes and in
rounds."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

_counting: CommStats | None = None
"""The stats whose step is open (:meth:`CommStats.count_rounds`): the collectives launched now
are its rounds."""


def count_collective() -> None:
    """Note one collective launched (at each ``torch.distributed`` call of a step's exchange):
    a round of the step being counted, if any."""
    if _counting is not None:
        _counting.open_rounds += 1


@dataclass
class CommStats:
    """Bytes this rank sent and communication rounds it waited on, per step and in total, split
    by stage, and what an fp32 allreduce would have sent in their place.

    Stages are named by the optimizer (``"warmup"``, ``"compression"``, ``"local"``...).
    A round is one collective call the step launched and waited on (an ``all_reduce``, an
    ``all_to_all`` or an all-gather, however many buckets it carries): on a link with a long
    round trip each costs at least that latency, whatever its size. A compressed allreduce is
    two rounds, an fp32 one per bucket is one, a local step none.
    ``rounds_skipped`` counts steps that needed no communication at all (0/1 Adam's local steps).
    ``fp32_bytes_total`` is the figure to compare against: what DDP's fp32 ring allreduce of the
    same gradients would have sent from this rank over the same ``step()`` calls, and
    :attr:`fewer_bytes` the ratio of the two.

    Attributes:
        last_step_bytes: bytes the last step sent.
        last_step_stage: the stage of the last step.
        last_step_rounds: the collectives the last step launched.
        total_bytes: bytes sent so far, by stage.
        rounds: collectives launched so far, by stage.
        steps: steps so far, by stage, skipped ones included (and 0/1 Adam's
            ``synchronize()`` calls, as stage ``"synchronize"``).
        rounds_skipped: steps that sent nothing where a synchronous optimizer would have.
        freeze_step: the optimizer's ``freeze_step`` (0/1 Adam's ``var_freeze_step``); with
            ``freeze_step="auto"``, ``None`` until it chose one.
        fp32_bytes_total: bytes an fp32 ring allreduce of the gradients would have sent from
            this rank over the same steps (DDP's traffic; for FSDP2, that of the shard across
            the replicas). 0/1 Adam's ``synchronize()`` calls add nothing to it.
    """

    last_step_bytes: int = 0
    last_step_stage: str = ""
    last_step_rounds: int = 0
    total_bytes: dict[str, int] = field(default_factory=dict)
    rounds: dict[str, int] = field(default_factory=dict)
    steps: dict[str, int] = field(default_factory=dict)
    rounds_skipped: int = 0
    freeze_step: int | None = None
    fp32_bytes_total: int = 0
    open_rounds: int = field(default=0, repr=False)
    """The collectives of the step being counted so far (:meth:`count_rounds`)."""

    def count_rounds(self) -> None:
        """Count the collectives launched from now on (:func:`count_collective`) as the rounds
        of the step that :meth:`record` books next: the optimizer calls it when it opens a
        step, and :meth:`stop_counting` when it closes it."""
        global _counting
        _counting, self.open_rounds = self, 0

    def stop_counting(self) -> None:
        """Stop counting collectives as this step's rounds (:meth:`count_rounds`)."""
        global _counting
        if _counting is self:
            _counting = None

    def record(
        self, stage: str, nbytes: int, round_skipped: bool = False, fp32_bytes: int = 0
    ) -> None:
        """Account one step of ``stage`` that sent ``nbytes`` in the collectives counted since
        :meth:`count_rounds`; ``round_skipped`` if it sent nothing where a synchronous
        optimizer would have communicated; ``fp32_bytes``, what an fp32 allreduce would have
        sent in its place."""
        self.fp32_bytes_total += fp32_bytes
        self.last_step_bytes = nbytes
        self.last_step_stage = stage
        self.last_step_rounds, self.open_rounds = self.open_rounds, 0
        self.total_bytes[stage] = self.total_bytes.get(stage, 0) + nbytes
        self.rounds[stage] = self.rounds.get(stage, 0) + self.last_step_rounds
        self.steps[stage] = self.steps.get(stage, 0) + 1
        self.rounds_skipped += round_skipped

    @property
    def bytes_total(self) -> int:
        """Bytes sent so far, all stages together."""
        return sum(self.total_bytes.values())

    @property
    def rounds_total(self) -> int:
        """Collectives launched so far, all stages together."""
        return sum(self.rounds.values())

    @property
    def fewer_bytes(self) -> float:
        """How many times fewer bytes this rank sent than an fp32 allreduce would have:
        ``fp32_bytes_total / bytes_total`` (``inf`` if nothing was sent yet where the allreduce
        would have sent something, 1.0 before the first step)."""
        if self.bytes_total == 0:
            return 1.0 if self.fp32_bytes_total == 0 else float("inf")
        return self.fp32_bytes_total / self.bytes_total

    def mean_bytes_per_step(self, stage: str) -> float:
        """Average bytes per step of ``stage`` so far (0 if none)."""
        steps = self.steps.get(stage, 0)
        return self.total_bytes.get(stage, 0) / steps if steps else 0.0

    def state_dict(self) -> dict:
        state = asdict(self)
        del state["open_rounds"]
        return state

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, dict(value) if isinstance(value, dict) else value)
