"""Training: the loop (``trainer``), optimizers and schedules (``optim``), progress line and loss plot."""

from k3.train.optim import Muon, build_optimizer, lr_factor
from k3.train.trainer import TrainArgs, TrainResult, train

__all__ = ["Muon", "TrainArgs", "TrainResult", "build_optimizer", "lr_factor", "train"]
