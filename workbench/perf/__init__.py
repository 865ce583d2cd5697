"""How long things take: the HLO cost reading, the roofline prediction, the formulas, the
physical bounds, profiles read back and calibration (``import workbench.perf``; its
``__all__`` is public, and ``workbench.perf.formulas`` the hand counts).

``workbench.planning`` plans a step (what it holds, which collectives it runs); this
package says how long it takes, from a plan's numbers and one hardware spec that the
caller resolves (``workbench.hardware.effective_spec``: the catalogue's entry or the
measured CPU, then a calibration; nothing here reads a stored calibration), and checks
that against a profile.

Modules: ``hlo`` (collectives, loop trip counts and the TPU compiler's cycle estimates
read from a compiled program's text), ``predict`` (the roofline of a ``StepCost`` on one
spec: step time, MFU, the bound; ``prediction``: the ``Prediction`` it returns;
``collective_time``: one collective timed over its links), ``predict_plan`` (the one
predictor of a plan: a ``PlanReport``'s numbers as a ``StepCost``, fed to it), ``analytic`` and
``attention_cost`` (formulas, public as ``formulas``), ``bounds`` (what no prediction may
beat), ``trace`` (a ``jax.profiler`` trace read into time per category and op),
``profile`` (predicted vs measured, term by term), ``calibrate`` (achieved rates fitted
to profiles: ``wb.calibrate``, stored as a ``wb.hardware.Calibration`` and removed with
``wb.remove_calibration``; ``fit_collectives``: each collective kind's latency per message
and bandwidth per link, fitted to several profiles at once). Formulas and sources:
docs/predictions.md.
"""
from workbench.perf import formulas
from workbench.perf._bounds import MFU_CEILING, implausible
from workbench.perf._calibrate import fit_collectives
from workbench._compiled.hlo import Collective, parse_collectives
from workbench.perf._cost import StepCost
from workbench.perf._collective_time import CollectiveTime, collective_seconds
from workbench.perf._predict import predict
from workbench.perf._prediction import Prediction
from workbench.perf._predict_plan import predict_plan
from workbench.perf._profile import ProfileReport, Term, profile_report
from workbench.perf._trace import StepProfile, read_trace, trace_files

__all__ = ["MFU_CEILING", "Collective", "CollectiveTime", "Prediction", "ProfileReport",
           "StepCost", "StepProfile", "Term", "collective_seconds", "fit_collectives",
           "formulas", "implausible", "parse_collectives", "predict", "predict_plan",
           "profile_report", "read_trace", "trace_files"]
