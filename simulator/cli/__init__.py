"""The ``clustersim`` command: one entry point with subcommands.
"""
