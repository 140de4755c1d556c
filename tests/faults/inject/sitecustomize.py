"""Test-only fault injection for processes started by a real launcher (deepspeed,
torchrun): Python imports this module at start-up when this directory is on PYTHONPATH.
``MOLDS_TEST_FAULT=hang:RANK:STEP`` makes rank RANK stop answering at its STEP-th
training step (it sleeps inside the step, as a peer stuck in a kernel or on I/O would).
``MOLDS_TEST_FAULT=kill:RANK:STEP`` makes rank RANK SIGKILL itself as its STEP-th training
step begins, once per job: it first creates the file ``MOLDS_TEST_FAULT_MARK`` names, and
does nothing where that file exists (a restarted attempt runs on; torchrun may give rank
RANK to the other node then). A rank lost at a known step, whatever the machine's speed.
molds itself has no fault hooks."""

import os

_fault = os.environ.get("MOLDS_TEST_FAULT", "")
_kind = _fault.split(":")[0]
if _kind in ("hang", "kill") and os.environ.get("RANK") is not None:
    _, _rank, _step = _fault.split(":")
    if int(os.environ["RANK"]) == int(_rank):
        import signal
        import time

        from molds.engines import ddp as _ddp
        from molds.engines import zero as _zero

        def _fail():
            if _kind == "hang":
                time.sleep(3600)
            else:
                try:
                    open(os.environ["MOLDS_TEST_FAULT_MARK"], "x").close()
                except FileExistsError:
                    return
                os.kill(os.getpid(), signal.SIGKILL)

        for _cls in (_ddp.DDPEngine, _zero.ZeroEngine):
            _original = _cls.train_step

            def _faulty(self, micro, _original=_original, _count=[0]):
                _count[0] += 1
                if _count[0] == int(_step):
                    _fail()
                return _original(self, micro)

            _cls.train_step = _faulty
