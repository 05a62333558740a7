"""One module per ``clustersim`` command: its help line, worked example, options
(``add_parser``) and what it runs (``run``), which imports its heavy modules lazily.
"""
