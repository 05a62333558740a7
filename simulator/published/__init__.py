"""Published runs set beside the simulation (``clustersim validate-runs FILE.csv``): each
row of a table of measured runs becomes a scenario (``mapping``), is simulated and
compared in the row's own unit (``compare``), and the errors are summarised by regime
and drawn (``report``). A row the simulator cannot express is listed with the reason.
"""
