"""The compiled step's kinds, which the compiler (:mod:`simulator.engine.compile`), the
laid copies (:mod:`simulator.engine.blocks`) and the streams
(:mod:`simulator.engine.streams`) share: a step is a tuple ``(kind, deps, a, b, g,
tail, dependents, lead)`` read by kind."""

RUN, COLL, SEND = 0, 1, 2
