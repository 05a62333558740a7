"""The small scenario the CLI, run-directory and fuzz tests start from: tiny-gpt on one
DGX node as TP 2 · PP 2 · DP 2 (one text, so that a change to it reaches all of them)."""

SMALL = """\
name: small
model: {preset: tiny-gpt}
cluster: {system: dgx-a100-80gb, nodes: 1, gpus_per_node: 8}
parallel: {tp: 2, pp: 2, dp: 2, schedule: 1f1b}
training: {global_batch: 16, micro_batch: 2, dtype: bf16}
"""
