"""Where a run stands, as one typed record: saved with every checkpoint and restored as a whole on resume."""

from dataclasses import dataclass, field, fields


@dataclass
class TrainState:
    global_step: int = 0
    epoch: int = 0
    batches_in_epoch: int = 0  # of `epoch`, up to the last optimizer step
    num_processes: int = 1
    best_metric: float | None = None
    best_metrics: dict = field(default_factory=dict)  # every evaluation metric at the best one
    best_checkpoint: str | None = None
    evals_without_improvement: int = 0
    # train_loss: the step losses (over all ranks) of this epoch's steps so far, and how many steps that is. Each rank
    # sums its part in float32 until the run ends; a checkpoint keeps those sums as they are (epoch_loss_by_rank), so
    # that train_loss does not depend on where checkpoints fell. epoch_loss_sum holds what older checkpoints folded.
    epoch_loss_sum: float = 0.0
    epoch_steps: int = 0
    epoch_loss_by_rank: list[float] = field(default_factory=list)

    def advance(self, epoch: int, batches_in_epoch: int):
        """One optimizer step done, after `batches_in_epoch` batches of `epoch`."""
        self.global_step += 1
        self.epoch_steps += 1
        self.epoch, self.batches_in_epoch = epoch, batches_in_epoch

    def improved(self, value: float, greater_is_better: bool) -> bool:
        best = self.best_metric
        return best is None or (value > best if greater_is_better else value < best)

    @classmethod
    def from_dict(cls, saved: dict) -> "TrainState":
        """From a checkpoint's training_state.json (which also holds the run's settings, ignored here)."""
        return cls(**{f.name: saved[f.name] for f in fields(cls) if f.name in saved and saved[f.name] is not None})
