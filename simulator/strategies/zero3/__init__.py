"""ZeRO-3 / FSDP: parameters sharded too, each unit gathered before use and its
gradients reduce-scattered as they complete.
"""
