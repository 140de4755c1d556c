"""What the fork server of ``tests/dist/spawn.py`` imports before it forks ranks: the
libraries a rank of the tests loads, each where it imports (one that fails to import is left
for the rank to import, and fail, itself)."""

import importlib

for _name in ("torch", "numpy", "pyarrow", "pyarrow.parquet", "deepspeed", "transformers", "safetensors.torch",
              "rdkit.Chem", "molds.train", "molds.engines.ddp", "molds.engines.zero", "molds.engines.pipeline",
              "molds.engines.dualpipev", "molds.checkpoint", "molds.eval.evaluate", "tests.faults.common",
              # what a rank imports later, at its first step: the optimizer's torch._dynamo (Optimizer's methods
              # import it at their first call), and DeepSpeed's Muon module, imported by each ZeRO and BF16
              # optimizer and pipeline engine at its start (its kernels' torch.compile decorators load
              # inductor: 5 s a rank on a 2-core EPYC)
              "torch._dynamo", "deepspeed.runtime.zero.muon.muon_optimizer"):
    try:
        importlib.import_module(_name)
    except Exception:  # noqa: BLE001 - the rank meets the error itself, where it can be reported
        pass
