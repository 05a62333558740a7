"""A real job's profiler traces set beside the simulation (``clustersim compare-trace DIR
SCENARIO``): every rank's Kineto traces are read bounded (``reader``), cut into kernel
classes and stream overlap per step (``classes``, ``measured``), the scenario's
simulation is cut the same way (``simulated``), and the two are compared by class and by
rank (``compare``) and written and drawn (``report``). Pure Python: no torch.
"""
