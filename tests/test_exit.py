"""How ``molds-train`` ends its process (``molds.runtime.lifecycle.exit_process``): with the exit
status asked, after what a normal exit does for the outside world, without the interpreter's
teardown."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_exit_process_keeps_what_a_normal_exit_does_for_the_outside_world(tmp_path):
    """A worker thread that is no daemon finishes its file, a thread pool's idle workers end, the
    atexit handlers run (one of them the logging module's flush), text still buffered on stdout and
    stderr arrives, and the status is the one asked; an object's ``__del__`` (the interpreter's
    teardown) is what is left out."""
    code = textwrap.dedent(f"""
        import atexit, logging, sys, threading, time
        from molds.runtime.lifecycle import exit_process

        def slow():
            time.sleep(0.5)
            open({str(tmp_path / "thread.txt")!r}, "w").write("finished")

        threading.Thread(target=slow).start()
        from concurrent.futures import ThreadPoolExecutor
        pool = ThreadPoolExecutor(2)  # idle workers that end only when told to, as at a normal exit
        pool.submit(time.sleep, 0.1).result()
        atexit.register(lambda: open({str(tmp_path / "atexit.txt")!r}, "w").write("ran"))
        handler = logging.FileHandler({str(tmp_path / "log.txt")!r}, delay=True)
        logging.getLogger("x").addHandler(handler)
        logging.getLogger("x").warning("logged")

        class Teardown:
            def __del__(self):
                open({str(tmp_path / "teardown.txt")!r}, "w").write("torn down")

        kept = Teardown()
        sys.stdout.write("out without a newline")
        sys.stderr.write("err without a newline")
        exit_process(3)
        print("never")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout == "out without a newline" and proc.stderr.endswith("err without a newline"), proc
    assert (tmp_path / "thread.txt").read_text() == "finished"
    assert (tmp_path / "atexit.txt").read_text() == "ran"
    assert (tmp_path / "log.txt").read_text() == "logged\n"
    assert not (tmp_path / "teardown.txt").exists()  # the teardown a normal exit would have done
