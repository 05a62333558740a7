"""The calibrated two-rank terms, one module each: the interference factor, the
collective and send sync costs, the host time of DTensor's redistributions and the rank
spread.

Each term is measured by ranks 0 and 1 of the collectives' torchrun launch after the
collective sweep, and each module holds all of its term: the flag that asks for it, the
key of its record, its rounds (what both ranks run), the summary rank 0 prints, and the
fit the profile reads (its figure, the record it came from, its spread and what the
provenance says of it). :mod:`calibration.microbench.terms.registry` names them all, and
the worker, the launcher and the fitter iterate it; :mod:`calibration.microbench.terms.burst`
holds the compute burst and the alone / with / back-to-back sweep three of them share.
"""
