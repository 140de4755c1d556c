"""The run's processes: what keeps ranks together and files whole, whatever is trained.

- ``distributed``: process-group set-up for every launcher, one timeout for every
  collective, and a failed collective turned into one line naming the rank lost;
- ``heartbeat``: each rank's counter in the rendezvous store, read to tell which rank is gone;
- ``lifecycle``: what every run does at its start and end (seeds per rank, library chatter
  filtered, the code version and the machine for the lineage, leaving the process group);
- ``allocator``: host-memory allocator policies (training keeps freed memory; the ETL's
  larger per-thread cache);
- ``atomic``: write to a temporary, then rename: the one way molds and its ETL put files in
  place;
- ``pool``: a function over a list's chunks on spawned processes, in order (RDKit work over
  a corpus).

May import: ``molds.errors`` and the package's version (``molds.__version__``) only. The
recipe, the ETL and everything that runs a job build on it.

``molds.runtime`` was one module (now ``lifecycle``); its names stay importable from here.
"""

from .lifecycle import code_version, cpu_description, cuda, leave_process_group, machine, quiet_third_party, seed_rank

__all__ = ["code_version", "cpu_description", "cuda", "leave_process_group", "machine", "quiet_third_party",
           "seed_rank"]
