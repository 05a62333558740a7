"""The scenario as typed, frozen data: the schema, its cross-field rules, how a file
becomes a Scenario, the training stack, the layer placement and the variability.
Nothing here simulates.
"""
