"""Communication accounting: what each optimizer step handed to collectives."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class CommStats:
    """Bytes this rank sent, per step and in total, split by stage, and what an fp32 allreduce
    would have sent in their place.

    Stages are named by the optimizer (``"warmup"``, ``"compression"``, ``"local"``...).
    ``rounds_skipped`` counts steps that needed no communication at all (0/1 Adam's local steps).
    ``fp32_bytes_total`` is the figure to compare against: what DDP's fp32 ring allreduce of the
    same gradients would have sent from this rank over the same ``step()`` calls, and
    :attr:`fewer_bytes` the ratio of the two.

    Attributes:
        last_step_bytes: bytes the last step sent.
        last_step_stage: the stage of the last step.
        total_bytes: bytes sent so far, by stage.
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
    total_bytes: dict[str, int] = field(default_factory=dict)
    steps: dict[str, int] = field(default_factory=dict)
    rounds_skipped: int = 0
    freeze_step: int | None = None
    fp32_bytes_total: int = 0

    def record(
        self, stage: str, nbytes: int, round_skipped: bool = False, fp32_bytes: int = 0
    ) -> None:
        """Account one step of ``stage`` that sent ``nbytes``; ``round_skipped`` if it sent nothing
        where a synchronous optimizer would have communicated; ``fp32_bytes``, what an fp32
        allreduce would have sent in its place."""
        self.fp32_bytes_total += fp32_bytes
        self.last_step_bytes = nbytes
        self.last_step_stage = stage
        self.total_bytes[stage] = self.total_bytes.get(stage, 0) + nbytes
        self.steps[stage] = self.steps.get(stage, 0) + 1
        self.rounds_skipped += round_skipped

    @property
    def bytes_total(self) -> int:
        """Bytes sent so far, all stages together."""
        return sum(self.total_bytes.values())

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
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, dict(value) if isinstance(value, dict) else value)
