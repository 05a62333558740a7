"""clustersim: a calibrated discrete-event simulator of large-model training clusters.

The pipeline runs one way (see docs/design.md): Scenario → Layout → Workload →
Engine → Trace → Report. Each arrow is a plain function over plain data; this
package never imports torch (calibration and measured runs live in
``calibration`` and import it lazily).
"""

__version__ = "0.1.0"
