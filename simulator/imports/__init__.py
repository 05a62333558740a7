"""Importers: a framework's own training configuration -> a scenario YAML.

:mod:`simulator.imports.megatron` reads Megatron-LM launch arguments,
:mod:`simulator.imports.torchtitan` torchtitan TOML job configs; both fill a
:class:`simulator.imports.common.Draft` and list what they cannot map (docs/imports.md).
"""
