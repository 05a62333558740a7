"""Figures, one module per kind; they read results and tables, never live
simulation objects.
"""
