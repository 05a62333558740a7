"""What a run writes and reads back: run directories, the span table, timelines,
Chrome traces, diffs and the figures (``outputs.plots``).
"""
