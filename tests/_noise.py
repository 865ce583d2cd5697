"""What a learner must not see in a notebook: the log lines of absl, Orbax, libtpu and other
installed packages (tests/test_notebooks.py, tests/test_quiet.py)."""
import re

#: Output lines a learner must not see: what absl (Orbax logs through it), libtpu and
#: other installed packages print. absl's Python logger without a handler of its own
#: ("WARNING:absl:..."); the absl/glog line prefix of absl's Python handler and of C++
#: logging (XLA, libtpu: "E0000 00:00:1795870317.188758    1543 common_lib.cc:554] ...");
#: libtpu's start-up lines (printed before its logging starts, without a prefix); Orbax's
#: messages, whatever handler prints them; a Python warning raised in an installed
#: third-party package. Workbench's own warnings and errors are not matched: those are
#: for the learner to read.
THIRD_PARTY_NOISE = re.compile("|".join([
    r"^(DEBUG|INFO|WARNING|ERROR|CRITICAL):absl:",
    r"^[IWEF]\d{4} [\d:.]+\s+\d+ [\w./-]+:\d+\]",
    r"could not determine TPU|TPU_WORKER_HOSTNAMES|TPU_ACCELERATOR_TYPE|"
    r"Logging before InitGoogle|Source Location Trace|Failed to find host bounds",
    r"CheckpointManagerOptions|Given directory is read only",
    r"[/\\](site|dist)-packages[/\\](?!workbench[/\\])\S*:\d+: \w*Warning\b",
]))
