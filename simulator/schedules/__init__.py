"""Pipeline schedules as plain data: actions per rank, their traits, and a registry.
Nothing here knows SimPy or transformers.
"""
