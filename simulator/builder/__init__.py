"""The workload builder: per-rank programs of tasks for one step, assembled by the
strategies' passes over the pipeline walk.
"""
