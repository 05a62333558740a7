"""The job over days: failures, checkpoints and restarts around the step time
(goodput, time, energy and cost to train).
"""
