"""The kernel-level op inventory: every op of a layer, its ends and the optimizer, with
its FLOPs, bytes, cost class, kernels and the bytes it keeps for backward, by concern:
the vocabulary (``ops``), the dense layer (``dense``), the attention variants
(``attention``), tensor parallelism's collectives (``tensor_parallel``), a mixture of
experts (``experts``), sharded data parallelism's copies (``sharding``) and the
optimizer step (``optimizer``).
"""
