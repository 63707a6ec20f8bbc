"""When a run validates and checkpoints: one rule for ``creditrl train`` and the async learner."""

from __future__ import annotations

from dataclasses import dataclass

from creditrl.config.schema import TrainerConfig

__all__ = ["Schedule"]


@dataclass(frozen=True)
class Schedule:
    """The steps of a ``total_steps`` run that validate and checkpoint (step 0: before the
    first step)."""

    total_steps: int
    test_freq: int
    save_freq: int
    val_before_train: bool

    @classmethod
    def from_config(cls, cfg: TrainerConfig) -> Schedule:
        """The schedule ``trainer.*`` asks for."""
        return cls(cfg.total_steps, cfg.test_freq, cfg.save_freq, cfg.val_before_train)

    @property
    def validates_ever(self) -> bool:
        """Some step validates, so the held-out rows are needed."""
        return self.val_before_train or self.test_freq > 0

    def validates(self, step: int) -> bool:
        """Step 0 with ``val_before_train``; every ``test_freq`` steps and the last step
        (``test_freq`` 0: never after step 0)."""
        if step == 0:
            return self.val_before_train
        return self.test_freq > 0 and (step % self.test_freq == 0 or step == self.total_steps)

    def saves(self, step: int) -> bool:
        """Step ``step`` (1-based) saves: every ``save_freq`` steps (0: none) and the last."""
        return (self.save_freq > 0 and step % self.save_freq == 0) or step == self.total_steps
