"""Importing workbench registers no ``atexit`` handler; the first lock taken registers the
one that releases a block's lock at exit (``workbench/_run_lock.py``)."""
from __future__ import annotations

import subprocess
import sys
import textwrap

_SCRIPT = textwrap.dedent("""
    import atexit, json, sys
    import workbench._runs            # the lock's own dependency, imported first
    counts = [atexit._ncallbacks()]
    import workbench, workbench._run_lock as rl
    counts.append(atexit._ncallbacks())
    lock = rl.RunLock(sys.argv[1])
    block = lock.hold(what="test")
    block.__enter__()                 # held for a block, never left: exit must release it
    counts.append(atexit._ncallbacks())
    again = rl.RunLock(sys.argv[2]).hold(what="test")
    again.__enter__()
    counts.append(atexit._ncallbacks())
    print(json.dumps(counts))
""")


def test_import_registers_nothing_and_the_first_lock_registers_one(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    out = subprocess.run([sys.executable, "-c", _SCRIPT, str(a), str(b)], capture_output=True,
                         text=True, check=True, timeout=120)
    before, imported, first, second = map(int, out.stdout.strip()[1:-1].split(","))
    assert imported == before, "importing workbench._run_lock registered an atexit handler"
    assert first == before + 1 and second == first   # one handler, however many locks
    assert not (a / "job.lock").exists() and not (b / "job.lock").exists(), \
        "the locks held for a block were not released at interpreter exit"
