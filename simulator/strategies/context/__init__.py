"""Context parallelism: the sequence split over cp ranks, attention's keys and values
exchanged as a ring or an all-gather, or the heads split by all-to-alls (Ulysses), or
all-to-alls within groups and a ring across them.
"""
