"""`graphtrace.vllm.hooks.wake_on_signals`: a SIGTERM wakes a main thread asleep in a queue
(Note [lost SIGTERM] in graphtrace/vllm/hooks.py). No vLLM needed.

The child process below is an idle vLLM engine core in miniature: its main thread sleeps in
``queue.get()`` and its SIGTERM handler only wakes that queue. Its main thread blocks SIGTERM
(``pthread_sigmask``), so the kernel hands the signal to another thread: CPython's C handler
runs there and the main thread is not woken, which is the state a SIGTERM arriving just before
the main thread falls asleep leaves behind, made certain.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CHILD = textwrap.dedent("""
    import queue, signal, sys, threading, time
    from graphtrace.vllm import hooks

    inputs = queue.Queue()
    handled = []

    def handler(signum, frame):  # like vLLM's engine core: record the request, wake the loop
        handled.append(signum)
        inputs.put("shutdown")

    signal.signal(signal.SIGTERM, handler)
    if sys.argv[1] == "wake":
        assert hooks.wake_on_signals(lambda: inputs.put("wakeup"))
    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()  # takes the signal
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    print("ready", flush=True)
    while not handled:
        inputs.get()  # the engine core's idle wait: a lock acquire without timeout
    print("handled", handled, flush=True)
""")


def _run_child(mode: str, wait: float):
    """Start the child, SIGTERM it once it sleeps; (returncode or None if still asleep, stdout)."""
    proc = subprocess.Popen([sys.executable, "-c", CHILD, mode], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={"PYTHONPATH": str(ROOT), "PATH": ""})
    try:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
        time.sleep(0.2)  # let the main thread fall asleep in inputs.get()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            return None, ""
        return proc.returncode, proc.stdout.read() + proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()


@pytest.mark.skipif(not hasattr(signal, "pthread_sigmask"), reason="needs POSIX signals")
def test_a_sigterm_the_main_thread_did_not_take_still_wakes_it():
    # without the wake the handler never runs: the engine core would sleep until SIGKILLed
    code, _ = _run_child("plain", wait=1.5)
    assert code is None, "the child should be stuck: the simulation no longer loses the signal"
    code, out = _run_child("wake", wait=20)
    assert code == 0 and f"handled [{int(signal.SIGTERM)}]" in out, out


def test_wake_on_signals_refuses_outside_the_main_thread():
    import threading

    from graphtrace.vllm import hooks

    result = []
    t = threading.Thread(target=lambda: result.append(hooks.wake_on_signals(lambda: None)))
    t.start()
    t.join()
    assert result == [False]
