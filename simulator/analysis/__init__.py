"""What a simulation means: the accounting of every second, the analytic closed
form, metrics, what-if sensitivities, uncertainty and step distributions.
"""
