"""What the fork server of ``tests/dist/spawn.py`` imports before it forks ranks: the
libraries a rank of the tests loads, each where it imports (one that fails to import is left
for the rank to import, and fail, itself)."""

import importlib

for _name in ("torch", "numpy", "pyarrow", "pyarrow.parquet", "deepspeed", "transformers", "safetensors.torch",
              "rdkit.Chem", "molds.train", "molds.engines.ddp", "molds.engines.zero", "molds.engines.pipeline",
              "molds.engines.dualpipev", "molds.checkpoint", "molds.eval.evaluate", "tests.faults.common",
              # what a rank would otherwise import after the fork: torch._dynamo (torch.optim's Optimizer imports
              # it at its first add_param_group), and DeepSpeed's Muon module, which DeepSpeed's ZeRO and BF16
              # optimizers, and its engine under ZeRO, import as they start (its kernels' torch.compile decorators load
              # inductor: 5 s of CPU a rank on a 2-core EPYC)
              "torch._dynamo", "deepspeed.runtime.zero.muon.muon_optimizer"):
    try:
        importlib.import_module(_name)
    except Exception:  # noqa: BLE001 - the rank meets the error itself, where it can be reported
        pass
