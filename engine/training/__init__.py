"""`specserve train-draft`: an EAGLE-3 head for the served model, trained on this machine from the model's own answers
(engine/training/data.py) by training-time test (engine/training/ttt.py), written in the public layout
(engine/model/eagle3.py) that `--draft-model` takes. Like engine/calibration/, an offline tool the engine never
imports."""
from __future__ import annotations

from engine.training.train import COMPANION, TrainOptions, train_draft

__all__ = ["COMPANION", "TrainOptions", "train_draft"]
