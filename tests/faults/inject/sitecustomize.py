"""Test-only fault injection for processes started by a real launcher (deepspeed,
torchrun): Python imports this module at start-up when this directory is on PYTHONPATH.
``MOLDS_TEST_FAULT=hang:RANK:STEP`` makes rank RANK stop answering at its STEP-th
training step (it sleeps inside the step, as a peer stuck in a kernel or on I/O would).
molds itself has no fault hooks."""

import os

_fault = os.environ.get("MOLDS_TEST_FAULT", "")
if _fault.startswith("hang:") and os.environ.get("RANK") is not None:
    _, _rank, _step = _fault.split(":")
    if int(os.environ["RANK"]) == int(_rank):
        import time

        from molds.engines import ddp as _ddp
        from molds.engines import zero as _zero

        for _cls in (_ddp.DDPEngine, _zero.ZeroEngine):
            _original = _cls.train_step

            def _hung(self, micro, _original=_original, _count=[0]):
                _count[0] += 1
                if _count[0] == int(_step):
                    time.sleep(3600)
                return _original(self, micro)

            _cls.train_step = _hung
