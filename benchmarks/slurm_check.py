"""The multi-node guide's Slurm batch script under a real Slurm: two nodes on one machine.

    python benchmarks/slurm_check.py --out /tmp/slurm-check     # as root, Slurm and munge installed

A cluster is rarely at hand where molds is developed, so this stands one up on one Linux
machine: Slurm's controller, and two ``slurmd`` daemons each in its own network and UTS
namespace (``node1`` at 10.77.0.11, ``node2`` at 10.77.0.12 on a bridge), munge for
authentication. The jobs are Slurm's own: ``sbatch`` allocates both nodes, ``srun`` starts
one torchrun agent on each, and the agents meet at a c10d rendezvous on the first node's
address over the bridge, as they would over a cluster's network. What it checks:

- ``docs/guides/multi-node.md``'s batch script, as printed there with the substitutions
  ``tests/engines/test_multinode.py`` makes (one rank per node, a port, a CPU recipe:
  ``recipes/smoke/dense_zero2.json`` on the bundled sample, fp32) and the two resource
  directives a CPU-only cluster grants (no ``--gpus-per-node``, one CPU per task), trains on
  the two nodes with every step's loss equal to a one-node ``torchrun --nproc_per_node 2``
  run of the same arguments;
- ``scontrol requeue`` of the running job (Slurm's preemption and node-failure path): the
  job is killed, starts again on the allocation, continues from its newest checkpoint by the
  script's ``--checkpoint.resume auto`` and ends with the same losses.

Needs root (namespaces, the bridge, the daemons) and Debian's or any distribution's Slurm:
``apt-get install slurmctld slurmd slurm-client munge``. The cluster lives in ``OUT``
(``slurm.conf`` there, pointed at by ``SLURM_CONF``; ``/etc/slurm`` is not read) and is taken
down at the end, the lines it added to ``/etc/hosts`` removed. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
NODES = {"node1": "10.77.0.11", "node2": "10.77.0.12"}
HEAD_IP = "10.77.0.1"
BRIDGE = "br-molds"
HOSTS_MARK = "# molds slurm_check"


def docs_batch_script(port: int, train_args: list[str], *, cpu_resources: bool = False) -> str:
    """The guide's batch script as printed, with one rank per node, ``port`` for the
    rendezvous and ``train_args`` in place of the GPU recipe; ``cpu_resources`` also drops
    the GPU request and asks one CPU per task (what a CPU-only Slurm can grant)."""
    page = open(os.path.join(ROOT, "docs", "guides", "multi-node.md")).read()
    script = next(b for b in re.findall(r"```bash\n(.*?)```", page, re.S) if "#SBATCH" in b)
    subs = [("--nproc_per_node 8", "--nproc_per_node 1"), (":29400", f":{port}"),
            ("molds/train.py --recipe recipes/moe_fp8.json", " ".join(map(shlex.quote, train_args)))]
    if cpu_resources:
        subs += [("#SBATCH --gpus-per-node 8\n", ""), ("--cpus-per-task 32", "--cpus-per-task 1")]
    for old, new in subs:
        if old not in script:
            raise SystemExit(f"docs/guides/multi-node.md: the batch script no longer holds {old!r}; "
                             "update its substitutions here")
        script = script.replace(old, new)
    return script


def sh(*cmd, check=True, **kw):
    return subprocess.run(list(cmd), check=check, capture_output=True, text=True, **kw)


def train_args(out: str, steps: int) -> list[str]:
    return ["molds/train.py", "--recipe", "recipes/smoke/dense_zero2.json", "--data.manifest", "runs/quickstart/data",
            "--trainer.precision", "fp32", "--trainer.max_steps", str(steps), "--checkpoint.interval_steps", "50",
            "--checkpoint.keep_last", "0", "--logging.interval_steps", "1", "--logging.progress", "false",
            "--eval.interval_steps", "0", "--run.output_dir", out]


def losses(out: str) -> dict[int, float]:
    """Each step's loss in ``out/metrics.jsonl`` (read while the job writes it: a torn last
    line is dropped; a step logged again after the requeue keeps its later value)."""
    from molds.metrics.logger import read_metrics

    return {r["step"]: r["train/loss"] for r in read_metrics(os.path.join(out, "metrics.jsonl")) if "train/loss" in r}


class Cluster:
    """Slurm's controller in this namespace and one slurmd per node namespace."""

    def __init__(self, home: str):
        self.home = home
        self.conf = os.path.join(home, "slurm.conf")
        self.env = dict(os.environ, SLURM_CONF=self.conf)

    def write_conf(self):
        for d in ("state", "log", *(f"spool/{n}" for n in NODES)):
            os.makedirs(os.path.join(self.home, d), exist_ok=True)
        h = self.home
        nodes = "\n".join(f"NodeName={n} NodeAddr={ip} CPUs=1 RealMemory=4000 State=UNKNOWN" for n, ip in NODES.items())
        open(self.conf, "w").write(f"""ClusterName=molds-check
SlurmctldHost={os.uname().nodename}({HEAD_IP})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation={h}/state
SlurmdSpoolDir={h}/spool/%n
SlurmctldPidFile={h}/slurmctld.pid
SlurmdPidFile={h}/slurmd-%n.pid
SlurmctldLogFile={h}/log/slurmctld.log
SlurmdLogFile={h}/log/slurmd-%n.log
SlurmctldPort=16817
SlurmdPort=16818
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
JobRequeue=1
KillWait=10
MinJobAge=3600
{nodes}
PartitionName=check Nodes={",".join(NODES)} Default=YES MaxTime=INFINITE State=UP
""")
        open(os.path.join(h, "cgroup.conf"), "w").write("CgroupPlugin=cgroup/v1\n")

    @staticmethod
    def preflight():
        for tool in ("slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "sinfo", "munge", "munged", "ip",
                     "nsenter", "unshare"):
            if not shutil.which(tool):
                raise SystemExit(f"slurm_check: {tool} not found (apt-get install slurmctld slurmd slurm-client munge)")
        if os.geteuid() != 0:
            raise SystemExit("slurm_check: needs root (network namespaces, a bridge, the Slurm daemons)")

    def up(self):
        self.write_conf()
        if sh("munge", "-n", check=False).returncode != 0:
            sh("munged", "--force")
        sh("ip", "link", "add", BRIDGE, "type", "bridge")
        sh("ip", "addr", "add", f"{HEAD_IP}/24", "dev", BRIDGE)
        sh("ip", "link", "set", BRIDGE, "up")
        for i, (name, ip) in enumerate(NODES.items()):
            ns, veth = f"molds-{name}", f"vmolds{i}"
            sh("ip", "netns", "add", ns)
            sh("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth1", "netns", ns)
            sh("ip", "link", "set", veth, "master", BRIDGE)
            sh("ip", "link", "set", veth, "up")
            sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", "eth1")
            sh("ip", "-n", ns, "link", "set", "eth1", "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        with open("/etc/hosts", "a") as f:
            f.writelines(f"{ip} {name} {HOSTS_MARK}\n" for name, ip in NODES.items())
        sh("slurmctld", "-f", self.conf, env=self.env)
        time.sleep(2)
        for name in NODES:
            # nsenter, not `ip netns exec`: that remounts /sys, hiding the cgroup mounts slurmd needs
            sh("nsenter", f"--net=/run/netns/molds-{name}", "unshare", "--uts", "sh", "-c",
               f"hostname {name}; exec slurmd -N {name} -f {self.conf}", env=self.env)
        for _ in range(60):
            state = sh("sinfo", "-h", "-N", "-o", "%T", env=self.env, check=False).stdout.split()
            if len(state) == len(NODES) and all(s == "idle" for s in state):
                return
            time.sleep(1)
        raise SystemExit(f"slurm_check: the nodes never came up idle ({state}); see {self.home}/log")

    def down(self):
        sh("scancel", "--user", "root", env=self.env, check=False)
        for pid_file in [f"slurmd-{n}.pid" for n in NODES] + ["slurmctld.pid"]:
            path = os.path.join(self.home, pid_file)
            if os.path.exists(path):
                sh("kill", open(path).read().strip(), check=False)
        time.sleep(2)
        for name in NODES:
            sh("ip", "netns", "del", f"molds-{name}", check=False)
        sh("ip", "link", "del", BRIDGE, check=False)
        if os.path.exists("/etc/hosts"):
            lines = open("/etc/hosts").readlines()
            open("/etc/hosts", "w").writelines(line for line in lines if HOSTS_MARK not in line)

    def submit(self, script: str) -> str:
        proc = sh("sbatch", "--parsable", "--chdir", ROOT, "--output", os.path.join(self.home, "job-%j.log"),
                  "--open-mode", "append", script, env=self.env)
        return proc.stdout.strip().split(";")[0]

    def state(self, job: str) -> str:
        out = sh("scontrol", "show", "job", job, env=self.env, check=False).stdout
        m = re.search(r"JobState=(\S+)", out)
        return m.group(1) if m else "GONE"

    def wait(self, job: str, timeout: float, until=lambda s: s in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT",
                                                                   "NODE_FAIL", "OUT_OF_MEMORY", "GONE")):
        end = time.time() + timeout
        while time.time() < end:
            s = self.state(job)
            if until(s):
                return s
            time.sleep(1)
        raise SystemExit(f"slurm_check: job {job} still {self.state(job)} after {timeout:.0f} s")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="a new directory: the cluster's files, the runs, the logs")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--requeue_after", type=int, default=110, help="requeue the job once its log holds this step")
    args = p.parse_args(argv)
    Cluster.preflight()
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=False)
    os.chdir(ROOT)
    if not os.path.exists("runs/quickstart/data/manifest.json"):
        subprocess.run(["molds-preprocess", "--input", "molds/sample_data/moses_sample.csv.gz", "--smiles-column",
                        "SMILES", "--output", "runs/quickstart/data", "--split", "scaffold", "--split-fractions",
                        "0.8,0.1,0.1", "--tokenizer", "regex", "--workers", "2"], check=True)
    result = {"metric": "slurm_check", "steps": args.steps}
    # the reference: one node, two ranks
    ref = os.path.join(out, "one-node")
    t = time.time()
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                    *train_args(ref, args.steps)], check=True, capture_output=True, text=True)
    result["one_node_s"] = round(time.time() - t, 1)
    cluster = Cluster(os.path.join(out, "cluster"))
    try:
        cluster.up()
        result["slurm"] = sh("sinfo", "--version").stdout.strip()
        run = os.path.join(out, "two-nodes")
        script = os.path.join(out, "train.sh")
        open(script, "w").write(docs_batch_script(29400 + os.getpid() % 500, train_args(run, args.steps),
                                                  cpu_resources=True))
        t = time.time()
        job = cluster.submit(script)
        cluster.wait(job, 300, until=lambda s: s != "PENDING")
        end = time.time() + 300
        while max(losses(run), default=0) < args.requeue_after:
            if time.time() > end or cluster.state(job) not in ("RUNNING", "CONFIGURING"):
                raise SystemExit(f"slurm_check: job {job} is {cluster.state(job)} before step {args.requeue_after}")
            time.sleep(0.5)
        result["requeued_at_step"] = max(losses(run))
        sh("scontrol", "requeue", job, env=cluster.env)
        final = cluster.wait(job, 900)
        result["two_nodes_s"] = round(time.time() - t, 1)
        result["job_state"] = final
        detail = sh("scontrol", "show", "job", job, env=cluster.env, check=False).stdout
        m = re.search(r"Restarts=(\d+)", detail)
        result["job_restarts"] = int(m.group(1)) if m else None
        m = re.search(r"(?m)^\s+NodeList=(\S+)", detail)
        result["nodes"] = m.group(1) if m else None
    finally:
        cluster.down()
    a, b = losses(ref), losses(run)
    worst = max((abs(a[s] - b[s]) / max(abs(a[s]), 1e-12) for s in a if s in b), default=None)
    lineage = json.load(open(os.path.join(run, "checkpoints", f"step-{args.steps:08d}", "lineage.json")))
    result.update(steps_logged=sorted(b) == list(range(1, args.steps + 1)), max_rel_loss_diff=worst,
                  world_size=lineage.get("world_size"), resumed_from=os.path.basename(lineage.get("resumed_from") or ""),
                  commit=sh("git", "rev-parse", "--short", "HEAD", check=False).stdout.strip())
    ok = (final == "COMPLETED" and result["steps_logged"] and worst is not None and worst <= 1e-6
          and result["resumed_from"] and result["job_restarts"])
    result["ok"] = bool(ok)
    print(json.dumps(result))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
