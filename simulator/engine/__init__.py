"""The SimPy world that runs a workload: compute and communication streams, links
with fair-share bandwidth, and collective rendezvous.
"""
