"""Offline tools that drive an Engine and write the artifacts drafters use: the model bigram table, PLD+'s
calibration, SV's acceptance tables and SPECTRA's retrieval corpus (`specserve calibrate
{bigram,pld-plus,sv,corpus}`). The engine never imports this package; it loads what these tools wrote through
engine/artifacts.py."""
from __future__ import annotations

from engine.calibration.bigram import build_bigram
from engine.calibration.corpus import build_corpus
from engine.calibration.options import CalibrationOptions
from engine.calibration.pld_plus import calibrate_pld_plus
from engine.calibration.sv import write_sv_tables

ARTIFACTS = {  # name -> (EngineConfig, CalibrationOptions) -> None: builds the artifact and says where it went
    "bigram": build_bigram,
    "pld-plus": calibrate_pld_plus,
    "sv": write_sv_tables,
    "corpus": build_corpus,
}

__all__ = ["ARTIFACTS", "CalibrationOptions"]
