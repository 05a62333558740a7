"""One module per parallelism: its scenario rules, its workload pass, its analytic
and memory terms, its planner dimension and the accounting kinds it adds.
"""
