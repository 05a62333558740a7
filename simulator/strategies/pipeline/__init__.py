"""Pipeline parallelism: the schedule's actions walked into compute tasks and
point-to-point sends (the walk every other strategy hooks into), the fill and drain.
"""
