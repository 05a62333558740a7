"""Context parallelism: the sequence split over cp ranks, attention's keys and values
exchanged as a ring or an all-gather.
"""
