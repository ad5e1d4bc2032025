"""Two (or four) "hosts" on one machine, joined by a shaped network: shardwise against FSDP2, FSDP1, DDP, DeepSpeed.

    sudo python bench/netns_bench.py --hosts 2 --nproc-per-host 2 --steps 4 --warmup 2 --repeats 2
    sudo python bench/netns_bench.py --hosts 4 --nproc-per-host 1 --configs shardwise:full_shard,fsdp2,ddp
    sudo python bench/netns_bench.py --cleanup          # only remove what a crashed run left behind

Each host is a network namespace with one veth link to a bridge in the root namespace. Both ends of every
link are shaped with tc (htb rate, plus netem delay where the kernel has netem), so each host has a
full-duplex link of the given rate, as a NIC to a switch. One ``torchrun`` agent per namespace
(``ip netns exec``, c10d rendezvous on host 0's address) starts ``--nproc-per-host`` ranks; gloo talks over
the veth (GLOO_SOCKET_IFNAME), ranks of the same host over loopback (the "NVLink" of this toy cluster).

Every configuration runs on the unshaped network (its compute time, T_compute) and on the shaped one
(T_step); bytes per step per link come from the veth's tx/rx counters around the measured steps. The
models, data, optimizer and per-implementation setup are bench/compare_cpu.py's (imported, not copied).
The default link rate is derived from a calibration run so that communication takes about as long as
compute. See bench/README.md for the overlap definition and its caveats.

The same file is the driver (default) and the per-rank worker (``--worker``, internal, under torchrun).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare_cpu as cc  # bench/ is not a package; compare_cpu puts the repo root on sys.path
import torch.distributed as dist

from shardwise.errors import ShardwiseError
from shardwise.models import GPT, PRESETS, GPTConfig
from shardwise.engine.base.strategy import Strategy

DEFAULT_CONFIGS = (
    "shardwise:full_shard", "shardwise:full_shard:noprefetch", "shardwise:full_shard:bf16",
    "shardwise:hybrid_shard", "shardwise:shard_grad_op", "shardwise:shard_optim", "shardwise:shard_optim_grad",
    "fsdp2", "fsdp2:bf16", "fsdp1", "fsdp1:bf16", "ddp", "ddp:bf16", "deepspeed", "deepspeed:bf16",
)
CALIBRATION_CONFIG = "shardwise:full_shard"
RDZV_PORT = 29400  # on host 0's address; namespaces have their own port space, so no clash with the machine
AGENT_KILL_GRACE_S = 5.0  # SIGTERM lets torchrun stop its ranks; then whatever is left in the namespaces is killed


# --------------------------------------------------------------------------------------------------------
# The network: namespaces, veth links, a bridge, tc shaping
# --------------------------------------------------------------------------------------------------------


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run one iproute2 command; on failure raise with the command and its stderr."""
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)  # raised below, with stderr
    if check and res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {res.stderr.strip() or f'exit {res.returncode}'}")
    return res


def parse_rate(text: str) -> int:
    """'100mbit', '2.5gbit', '800kbit', '1000000' (bit/s) -> bit/s, the units tc uses."""
    m = re.fullmatch(r"([0-9.]+)\s*(k|m|g)?(?:bit)?", text.strip().lower())
    if not m:
        raise argparse.ArgumentTypeError(f"--rate {text!r}: expected e.g. 100mbit, 2gbit or auto")
    return int(float(m.group(1)) * {None: 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)])


def fmt_rate(bps: float) -> str:
    return f"{bps / 1e9:.2f} Gbit/s" if bps >= 1e9 else f"{bps / 1e6:.0f} Mbit/s"


@dataclass
class ShapedNetwork:
    """N namespaces ``<prefix>-h<i>``, each with veth ``<prefix>h<i>`` (inside) / ``<prefix>b<i>`` (on the bridge)."""

    prefix: str
    hosts: int
    subnet: str = "192.168.213"  # host i is <subnet>.<i+1>/24
    netem_missing: bool = False  # set when the kernel rejected netem: links are then shaped for rate only

    def ns(self, i: int) -> str:
        return f"{self.prefix}-h{i}"

    def inner_if(self, i: int) -> str:
        return f"{self.prefix}h{i}"

    def outer_if(self, i: int) -> str:
        return f"{self.prefix}b{i}"

    @property
    def bridge(self) -> str:
        return f"{self.prefix}br"

    def ip(self, i: int) -> str:
        return f"{self.subnet}.{i + 1}"

    def up(self) -> None:
        self.remove_leftovers()
        sh("ip", "link", "add", self.bridge, "type", "bridge")
        sh("ip", "link", "set", self.bridge, "up")
        for i in range(self.hosts):
            sh("ip", "netns", "add", self.ns(i))
            sh("ip", "link", "add", self.outer_if(i), "type", "veth", "peer", "name", self.inner_if(i))
            sh("ip", "link", "set", self.inner_if(i), "netns", self.ns(i))
            sh("ip", "link", "set", self.outer_if(i), "master", self.bridge)
            sh("ip", "link", "set", self.outer_if(i), "up")
            sh("ip", "-n", self.ns(i), "addr", "add", f"{self.ip(i)}/24", "dev", self.inner_if(i))
            sh("ip", "-n", self.ns(i), "link", "set", self.inner_if(i), "up")
            sh("ip", "-n", self.ns(i), "link", "set", "lo", "up")  # ranks of one host talk over loopback

    def _ends(self):
        """(namespace or None for the root namespace, interface) for both ends of every link."""
        for i in range(self.hosts):
            yield self.ns(i), self.inner_if(i)  # egress: what host i sends
            yield None, self.outer_if(i)  # egress from the bridge into host i: what it receives

    @staticmethod
    def _tc(ns: str | None, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return sh("tc", *(["-n", ns] if ns else []), *args, check=check)

    def shape(self, rate_bps: int, delay_us: int) -> None:
        """htb at rate_bps on both ends of every link (full duplex), a netem delay leaf when delay_us > 0."""
        self.unshape()
        # Bursts must hold at least one GSO super-packet (64 KiB) or htb cannot reach its rate on veth.
        burst = max(2 * 65536, rate_bps // 8 // 1000)  # and about 1 ms worth at the rate
        for ns, dev in self._ends():
            self._tc(ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "10")
            self._tc(ns, "class", "add", "dev", dev, "parent", "1:", "classid", "1:10", "htb",
                     "rate", f"{rate_bps}bit", "ceil", f"{rate_bps}bit", "burst", str(burst), "cburst", str(burst),
                     "quantum", "65536")
            if delay_us > 0 and not self.netem_missing:
                res = self._tc(ns, "qdisc", "add", "dev", dev, "parent", "1:10", "handle", "10:", "netem",
                               "delay", f"{delay_us}us", "limit", "100000", check=False)
                if res.returncode != 0:
                    self.netem_missing = True
                    print(f"# warning: no netem delay ({res.stderr.strip()}; the kernel lacks sch_netem): "
                          "links are shaped for rate only", flush=True)

    def unshape(self) -> None:
        for ns, dev in self._ends():
            self._tc(ns, "qdisc", "del", "dev", dev, "root", check=False)  # absent root qdisc: nothing to do

    def kill_processes(self) -> None:
        """SIGKILL every process still inside one of our namespaces (ranks orphaned by a killed agent)."""
        for name in self._our_namespaces():
            for pid in sh("ip", "netns", "pids", name, check=False).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def _our_namespaces(self) -> list[str]:
        names = [line.split()[0] for line in sh("ip", "netns", "list", check=False).stdout.splitlines() if line.strip()]
        return [n for n in names if re.fullmatch(rf"{self.prefix}-h\d+", n)]

    def _our_links(self) -> list[str]:
        links = sh("ip", "-o", "link", "show", check=False).stdout.splitlines()
        names = [line.split(":")[1].strip().split("@")[0] for line in links if ":" in line]
        # Exactly our names, so that prefix "nb" never touches the links of a run with prefix "nb2".
        return [n for n in names if re.fullmatch(rf"{self.prefix}(br|[hb]\d+)", n)]

    def remove_leftovers(self) -> list[str]:
        """Remove every namespace and link with our prefix (this run's, or a crashed earlier run's)."""
        removed = []
        self.kill_processes()
        for name in self._our_namespaces():
            sh("ip", "netns", "del", name, check=False)  # also deletes the veth end inside, hence its peer
            removed.append(name)
        for name in self._our_links():  # the bridge, and veth ends whose namespace was already gone
            sh("ip", "link", "del", name, check=False)
            removed.append(name)
        return removed

    def leftovers(self) -> list[str]:
        return self._our_namespaces() + self._our_links()


# --------------------------------------------------------------------------------------------------------
# Worker side: one rank under torchrun, inside a namespace
# --------------------------------------------------------------------------------------------------------


class LinkMeter(cc.Meter):
    """Bytes through this host's veth during the measured steps, from the namespace's own sysfs."""

    def __init__(self, ifname: str):
        self.stats = Path("/sys/class/net") / ifname / "statistics"
        self.before: dict[str, int] = {}

    def _read(self) -> dict[str, int]:
        return {d: int((self.stats / f"{d}_bytes").read_text()) for d in ("tx", "rx")}

    def start(self) -> None:
        dist.barrier()  # every rank has finished warmup: no warmup traffic is still on the wire
        self.before = self._read()

    def stop(self) -> dict:
        dist.barrier()  # every peer has received what this rank sent in the measured steps
        after = self._read()
        return {"link": self.stats.parent.name, **{f"{d}_bytes": after[d] - self.before[d] for d in after}}


def worker_main(spec_json: str, result_dir: Path) -> None:
    spec = cc.RunSpec(**json.loads(spec_json))
    cc.worker_main(spec, result_dir / f"rank{os.environ['RANK']}.json", LinkMeter(os.environ["GLOO_SOCKET_IFNAME"]))


# --------------------------------------------------------------------------------------------------------
# Driver side
# --------------------------------------------------------------------------------------------------------


@dataclass
class Config:
    """One row: ``impl[:strategy][:bf16][:noprefetch]``, e.g. ``shardwise:hybrid_shard`` or ``fsdp2:bf16``."""

    name: str
    impl: str
    options: dict = field(default_factory=dict)
    unavailable: str = ""  # why it is not run, when it is not

    @classmethod
    def parse(cls, name: str, nproc_per_host: int) -> Config:
        impl, *mods = name.split(":")
        if impl not in cc.SETUPS:
            raise argparse.ArgumentTypeError(f"--configs: unknown implementation {impl!r}; valid: {', '.join(cc.SETUPS)}")
        cfg = cls(name=name, impl=impl)
        if impl.startswith("shardwise"):
            strategy = mods.pop(0) if mods and mods[0] not in ("bf16", "noprefetch") else "full_shard"
            cfg.options["strategy"] = strategy
            try:
                parsed = Strategy.parse(strategy)
            except ShardwiseError as exc:  # e.g. a strategy another branch adds: reported, not fatal
                cfg.unavailable = f"unavailable: {exc}"
            else:
                if parsed.is_hybrid and nproc_per_host < 2:
                    cfg.unavailable = "unavailable: hybrid strategies need --nproc-per-host >= 2"
        for mod in mods:
            if mod == "bf16":
                cfg.options["reduce_dtype"] = "bfloat16"
            elif mod == "noprefetch" and impl.startswith("shardwise"):
                cfg.options["prefetch"] = False
            else:
                raise argparse.ArgumentTypeError(f"--configs {name!r}: unknown modifier {mod!r} (bf16, noprefetch)")
        return cfg


@dataclass
class NetRun:
    config: str
    shaped: bool
    repeat: int
    status: str
    median_step_s: float | None = None
    tx_bytes_per_step: float | None = None  # busiest host's link, host -> switch
    rx_bytes_per_step: float | None = None  # busiest host's link, switch -> host
    losses: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    note: str = ""  # e.g. an agent's non-zero exit after every rank had written its result
    # The machine's 1-minute load average when the run ended: other jobs on the same cores stretch step times.
    load_1min: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == "ok"


class Bench:
    def __init__(self, args: argparse.Namespace, net: ShapedNetwork, log_dir: Path):
        self.args, self.net, self.log_dir = args, net, log_dir
        self.runs_started = 0

    def spec(self, cfg: Config, steps: int, warmup: int) -> cc.RunSpec:
        a = self.args
        return cc.RunSpec(impl=cfg.impl, model=a.model, seq_len=a.seq_len, batch=a.batch, steps=steps,
                          warmup=warmup, seed=a.seed, lr=a.lr, options=cfg.options)

    def launch(self, cfg: Config, shaped: bool, repeat: int, spec: cc.RunSpec, tag: str = "") -> NetRun:
        """One run: one torchrun agent per namespace; wait; read every rank's result."""
        a, net = self.args, self.net
        self.runs_started += 1
        slug = re.sub(r"[^A-Za-z0-9_.-]", "_", cfg.name)
        run_dir = self.log_dir / f"{tag}{slug}-{'shaped' if shaped else 'unshaped'}-r{repeat}"
        run_dir.mkdir(parents=True, exist_ok=True)
        port = RDZV_PORT + self.runs_started  # a fresh port per run: no TIME_WAIT leftovers from the last one
        start = time.monotonic()
        procs = []
        for i in range(net.hosts):
            env = {**os.environ, "GLOO_SOCKET_IFNAME": net.inner_if(i), "OMP_NUM_THREADS": "1",
                   "MKL_NUM_THREADS": "1", "PYTHONPATH": str(cc.REPO_ROOT)}
            cmd = ["ip", "netns", "exec", net.ns(i), sys.executable, "-m", "torch.distributed.run",  # = torchrun
                   "--nnodes", str(net.hosts), "--nproc-per-node", str(a.nproc_per_host),
                   "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{net.ip(0)}:{port}",
                   "--rdzv-id", f"{net.prefix}{self.runs_started}",
                   # Every namespace has the machine's hostname, so torchrun cannot tell which agent should
                   # host the store, nor which address the others reach it at: say it explicitly.
                   "--rdzv-conf", f"is_host={int(i == 0)}", "--local-addr", net.ip(i),
                   "--max-restarts", "0", __file__, "--worker", json.dumps(dataclasses.asdict(spec)),
                   "--result-dir", str(run_dir)]
            with open(run_dir / f"host{i}.log", "w") as log:
                procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        try:
            _, _, timed_out = cc.wait_for_ranks(procs, a.timeout)  # here: agents, one per host
        finally:
            self.stop_agents(procs)
        run = NetRun(config=cfg.name, shaped=shaped, repeat=repeat, status="ok", wall_s=time.monotonic() - start,
                     load_1min=os.getloadavg()[0])
        self.read_results(run, run_dir, procs, timed_out, spec.steps)
        return run

    def stop_agents(self, procs: list[subprocess.Popen]) -> None:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)  # torchrun forwards it to its ranks and exits
        deadline = time.monotonic() + AGENT_KILL_GRACE_S
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.1)
        for p in procs:
            if p.poll() is None:
                cc.kill_rank(p)
        self.net.kill_processes()  # ranks live in their own sessions; nothing of this run may outlive it

    def read_results(self, run: NetRun, run_dir: Path, procs, timed_out: bool, steps: int) -> None:
        world = self.net.hosts * self.args.nproc_per_host
        reports = {r: json.loads(p.read_text()) for r in range(world) if (p := run_dir / f"rank{r}.json").exists()}
        errors = [rep["error"] for _, rep in sorted(reports.items()) if "error" in rep]
        # A peer's failure shows up on the others as a lost connection; the first other error is the cause.
        causes = [e for e in errors if not re.search(r"[Cc]onnection (closed|reset)|peer", e)] or errors
        if timed_out:
            run.status = f"timeout after {self.args.timeout:.0f} s"
        elif causes:
            run.status = "failed: " + cc.short(causes[0])
        elif len(reports) < world:
            bad = [i for i, p in enumerate(procs) if p.returncode]
            run.status = f"failed: {world - len(reports)} rank(s) wrote no result" + "".join(
                f"; host {i} exit {procs[i].returncode}: {cc.short(cc.last_line(run_dir / f'host{i}.log'))}" for i in bad)
        if not run.ok:
            return
        # Every rank finished and reported; a crash while the processes shut down does not void the numbers,
        # but the row says it happened.
        run.note = "; ".join(f"host {i} exit {p.returncode} after all ranks reported"
                             for i, p in enumerate(procs) if p.returncode)
        run.median_step_s = max(rep["median_step_s"] for rep in reports.values())
        run.losses = reports[0]["losses"]
        # Ranks of one host read the same counters; the busiest host's link is the figure.
        run.tx_bytes_per_step = max(rep["tx_bytes"] for rep in reports.values()) / steps
        run.rx_bytes_per_step = max(rep["rx_bytes"] for rep in reports.values()) / steps

    def calibrate(self) -> int:
        """Pick the link rate at which moving full_shard's bytes takes about as long as its compute."""
        a = self.args
        cfg = Config.parse(CALIBRATION_CONFIG, a.nproc_per_host)
        self.net.unshape()
        run = self.launch(cfg, shaped=False, repeat=0, spec=self.spec(cfg, steps=2, warmup=1), tag="calibration-")
        if not run.ok:
            sys.exit(f"netns_bench.py: calibration run ({CALIBRATION_CONFIG}, unshaped) {run.status}; pass --rate")
        link_bytes = max(run.tx_bytes_per_step, run.rx_bytes_per_step)
        raw = link_bytes * 8 / run.median_step_s
        rate = int(float(f"{raw:.2g}"))  # two significant digits
        n_params = sum(p.numel() for p in GPT.from_preset(a.model).parameters())
        print(f"# rate: {a.model} has {n_params / 1e6:.2f}M parameters = {n_params * 4 / 1e6:.1f} MB in fp32.\n"
              f"#   {CALIBRATION_CONFIG} on the unshaped network: {run.median_step_s:.3f} s/step (compute, plus "
              f"the CPU cost of moving bytes over veth), busiest link {link_bytes / 1e6:.1f} MB/step "
              f"({link_bytes / (n_params * 4):.1f}x the fp32 parameters: all-gather in forward and backward, "
              "reduce-scatter in backward).\n"
              f"#   {link_bytes / 1e6:.1f} MB * 8 / {run.median_step_s:.3f} s = {fmt_rate(raw)}; at "
              f"{fmt_rate(rate)} moving a step's bytes takes about as long as computing it, as on a GPU "
              "cluster where communication and compute are of the same order.", flush=True)
        return rate


# --------------------------------------------------------------------------------------------------------
# The table
# --------------------------------------------------------------------------------------------------------


def overlap(t_compute: float, t_comm: float, t_step: float) -> float:
    """Share of the smaller of compute and communication that ran concurrently with the other, in [0, 1]."""
    return min(1.0, max(0.0, (t_compute + t_comm - t_step) / min(t_compute, t_comm)))


def summarize(runs: list[NetRun], configs: list[Config], rate_bps: int) -> str:
    header = ("| config | shaped step s (min / median / max) | unshaped step s = T_compute (median) "
              "| MB/step per link, tx / rx (busiest host) | T_comm = bytes / rate, s | overlap | loss rank 0 (first → last) "
              "| load avg, shaped runs (min–max) |")
    rows = [header, "|---|---|---|---|---|---|---|---|"]
    for cfg in configs:
        if cfg.unavailable:
            rows.append(f"| {cfg.name} | {cc.short(cfg.unavailable, 140)} | — | — | — | — | — | — |")
            continue
        shaped = [r for r in runs if r.config == cfg.name and r.shaped]
        base = [r for r in runs if r.config == cfg.name and not r.shaped]
        ok, base_ok = [r for r in shaped if r.ok], [r for r in base if r.ok]
        if not ok:
            rows.append(f"| {cfg.name} | {'; '.join(sorted({r.status for r in shaped}))} | — | — | — | — | — | — |")
            continue
        cell = cc.min_med_max([r.median_step_s for r in ok], ".3f")
        notes = sorted({r.note for r in shaped + base if r.note})
        if notes:
            cell += f" ({'; '.join(notes)})"
        if len(ok) < len(shaped):
            cell += f" ({len(ok)}/{len(shaped)} ok; {'; '.join(sorted({r.status for r in shaped if not r.ok}))})"
        t_step = statistics.median(r.median_step_s for r in ok)
        tx = statistics.median(r.tx_bytes_per_step for r in ok)
        rx = statistics.median(r.rx_bytes_per_step for r in ok)
        t_comm = max(tx, rx) * 8 / rate_bps
        if base_ok:
            t_compute = statistics.median(r.median_step_s for r in base_ok)
            compute_cell = f"{t_compute:.3f}"
            overlap_cell = f"{overlap(t_compute, t_comm, t_step):.2f}" if t_comm > 0 else "—"
        else:
            compute_cell = "; ".join(sorted({r.status for r in base})) or "not run"
            overlap_cell = "—"
        loss = f"{ok[0].losses[0]:.4f} → {ok[0].losses[-1]:.4f}"
        loads = [r.load_1min for r in shaped]
        rows.append(f"| {cfg.name} | {cell} | {compute_cell} | {tx / 1e6:.2f} / {rx / 1e6:.2f} | {t_comm:.3f} "
                    f"| {overlap_cell} | {loss} | {min(loads):.1f}–{max(loads):.1f} |")
    return "\n".join(rows)


# --------------------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hosts", type=int, default=2, help="network namespaces, one torchrun agent each")
    p.add_argument("--nproc-per-host", type=int, default=2, help="ranks per host (hybrid_shard needs >= 2)")
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                   help="comma-separated impl[:strategy][:bf16][:noprefetch]; impls: " + ", ".join(cc.SETUPS))
    p.add_argument("--model", default="gpt-small", help="a preset from shardwise.models.PRESETS")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=4, help="per rank")
    p.add_argument("--steps", type=int, default=4, help="measured steps per run")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2, help="shaped runs per configuration, interleaved")
    p.add_argument("--baseline-repeats", type=int, default=1, help="unshaped (T_compute) runs per configuration")
    p.add_argument("--rate", default="auto", help="link rate per direction, e.g. 100mbit or 2gbit; auto: calibrate")
    p.add_argument("--delay-us", type=int, default=100, help="one-way netem delay per link end (needs sch_netem)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--timeout", type=float, default=300.0, help="wall-clock limit per run, seconds")
    p.add_argument("--prefix", default="swnb", help="name prefix of namespaces and links (<= 8 characters)")
    p.add_argument("--json", type=Path, default=None, help="write every run's numbers here")
    p.add_argument("--log-dir", type=Path, default=None, help="keep every host's output here")
    p.add_argument("--cleanup", action="store_true", help="only remove namespaces and links left with --prefix")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result-dir", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if len(args.prefix) > 8 or not re.fullmatch(r"[a-z][a-z0-9]*", args.prefix):
        p.error("--prefix: 1-8 lower-case letters/digits, starting with a letter (interface names are <= 15 chars)")
    if args.hosts < 2 or args.nproc_per_host < 1 or args.steps < 1 or args.repeats < 1:
        p.error("need --hosts >= 2, --nproc-per-host >= 1, --steps >= 1, --repeats >= 1")
    return args


def refuse_unless_able() -> None:
    """One line and exit when this machine cannot build the network."""
    if os.geteuid() != 0:
        sys.exit("netns_bench.py: needs root (it creates network namespaces, veth links and tc qdiscs)")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        sys.exit(f"netns_bench.py: needs iproute2; not found on PATH: {', '.join(missing)}")


def warn_stale_extension_locks(configs: list[Config]) -> None:
    """DeepSpeed JIT-builds an op on first use; a run killed mid-build leaves torch's lock file, and every later
    DeepSpeed run then waits on it until its timeout. Say so before the runs rather than after the timeouts."""
    if not any(c.impl == "deepspeed" for c in configs):
        return
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR", Path.home() / ".cache" / "torch_extensions"))
    for lock in root.glob("*/*/lock"):
        print(f"# warning: {lock} exists; if no build is running it is stale (a killed build) and DeepSpeed "
              "runs will hang on it: delete it", flush=True)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker is not None:
        worker_main(args.worker, args.result_dir)
        return
    refuse_unless_able()
    net = ShapedNetwork(prefix=args.prefix, hosts=args.hosts)
    if args.cleanup:
        removed = net.remove_leftovers()
        print(f"removed: {', '.join(removed)}" if removed else f"nothing with prefix {args.prefix!r} to remove")
        return
    block_size = GPTConfig(**PRESETS[args.model]).block_size if args.model in PRESETS else None
    if block_size is None or args.seq_len > block_size:
        sys.exit(f"netns_bench.py: --model {args.model!r} with --seq-len {args.seq_len}: need a preset of "
                 f"{', '.join(PRESETS)} whose block_size >= seq-len (it is {block_size})")
    try:
        configs = [Config.parse(name.strip(), args.nproc_per_host) for name in args.configs.split(",") if name.strip()]
    except argparse.ArgumentTypeError as exc:
        sys.exit(f"netns_bench.py: {exc}")
    warn_stale_extension_locks(configs)
    # SIGTERM (and SIGINT, as KeyboardInterrupt) unwind through the finally below, which tears the network down.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="shardwise-netns-"))
    runs: list[NetRun] = []
    try:
        net.up()
        bench = Bench(args, net, log_dir)
        rate = parse_rate(args.rate) if args.rate != "auto" else bench.calibrate()
        net.shape(rate, args.delay_us)  # once up front, so a missing netem is reported before the runs
        delay = "no delay (no netem)" if net.netem_missing or args.delay_us == 0 else f"{args.delay_us} us delay per end"
        print(f"# {args.hosts} hosts x {args.nproc_per_host} ranks, {args.model}, T={args.seq_len}, batch {args.batch} "
              f"per rank, {args.warmup} warmup + {args.steps} measured steps; links {fmt_rate(rate)} each way, "
              f"{delay}; {args.repeats} shaped + {args.baseline_repeats} unshaped run(s) per config", flush=True)
        for repeat in range(args.repeats):
            for cfg in configs:
                if cfg.unavailable:
                    continue
                for shaped in ([False] if repeat < args.baseline_repeats else []) + [True]:
                    if shaped:
                        net.shape(rate, args.delay_us)
                    else:
                        net.unshape()
                    run = bench.launch(cfg, shaped, repeat, bench.spec(cfg, args.steps, args.warmup))
                    runs.append(run)
                    detail = (f"{run.median_step_s:.3f} s/step, link tx {run.tx_bytes_per_step / 1e6:.2f} MB/step"
                              if run.ok else run.status)
                    print(f"  r{repeat + 1} {'shaped  ' if shaped else 'unshaped'} {cfg.name:<34} {detail}  "
                          f"({run.wall_s:.0f} s wall, load {run.load_1min:.1f})", flush=True)
    finally:
        net.remove_leftovers()
        left = net.leftovers()
        print(f"# network torn down{'; LEFT BEHIND: ' + ', '.join(left) if left else ''}", flush=True)
    print()
    print(summarize(runs, configs, rate))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"config": {k: str(v) for k, v in vars(args).items()}, "rate_bps": rate,
                                         "netem": not net.netem_missing, "runs": [dataclasses.asdict(r) for r in runs]},
                                        indent=2))
    if args.log_dir is None:
        shutil.rmtree(log_dir, ignore_errors=True)
    else:
        print(f"\nper-host logs: {log_dir}")


if __name__ == "__main__":
    main()
