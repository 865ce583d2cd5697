"""Reading what XLA compiled: the optimised HLO text of a compiled program (its
collectives with their replica groups and bytes, loops and trip counts, per-op costs and
source lines, memory spaces). A leaf: it imports nothing of Workbench, so the hardware
catalogue, planning, perf and the exercises all read programs through it."""
