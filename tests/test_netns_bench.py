"""bench/netns_bench.py: its configuration parsing and overlap figure, and (slow, root only) the shaped network
it builds: namespaces that reach each other over the bridge, counters that see the traffic, nothing left behind."""

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import netns_bench as nb


def test_config_names_map_to_setup_options():
    assert nb.Config.parse("shardwise:hybrid_shard:bf16", 2).options == {"strategy": "hybrid_shard",
                                                                        "reduce_dtype": "bfloat16"}
    assert nb.Config.parse("shardwise:noprefetch", 2).options == {"strategy": "full_shard", "prefetch": False}
    assert nb.Config.parse("ddp:bf16", 1).options == {"reduce_dtype": "bfloat16"}
    # A strategy shardwise does not know is a row that says so, not a crash of the whole benchmark.
    assert nb.Config.parse("shardwise:no_such_strategy", 2).unavailable.startswith("unavailable: strategy=")
    assert "nproc-per-host" in nb.Config.parse("shardwise:hybrid_shard", 1).unavailable
    assert nb.Config.parse("shardwise:full_shard", 1).unavailable == ""
    for bad in ("tensorflow", "ddp:noprefetch", "fsdp2:fp8"):
        with pytest.raises(Exception, match="--configs"):
            nb.Config.parse(bad, 2)


def test_overlap_is_the_hidden_share_of_the_shorter_phase():
    assert nb.overlap(t_compute=1.0, t_comm=0.5, t_step=1.0) == 1.0  # communication entirely hidden
    assert nb.overlap(t_compute=1.0, t_comm=0.5, t_step=1.5) == 0.0  # strictly one after the other
    assert nb.overlap(t_compute=1.0, t_comm=0.5, t_step=1.25) == pytest.approx(0.5)
    assert nb.overlap(t_compute=1.0, t_comm=0.5, t_step=2.0) == 0.0  # slower than serial: clipped
    assert nb.overlap(t_compute=1.0, t_comm=0.5, t_step=0.8) == 1.0  # faster than compute alone: clipped


def test_rates_parse_like_tc():
    assert nb.parse_rate("100mbit") == 100_000_000
    assert nb.parse_rate("2.5gbit") == 2_500_000_000
    assert nb.parse_rate("800k") == 800_000
    with pytest.raises(Exception, match="--rate"):
        nb.parse_rate("fast")


needs_root_and_iproute2 = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
    reason="builds network namespaces: needs root and iproute2",
)

# Sends 2 MB from host 1 to host 0 over the shaped link (run with `ip netns exec`).
SERVER = textwrap.dedent("""
    import socket, sys
    s = socket.create_server((sys.argv[1], 5001)); print("listening", flush=True)
    c, _ = s.accept(); n = 0
    while (b := c.recv(65536)): n += len(b)
    print(n, flush=True)
""")
CLIENT = "import socket, sys; c = socket.create_connection((sys.argv[1], 5001)); c.sendall(bytes(2_000_000)); c.close()"


def counter(net, host: int, direction: str) -> int:
    path = f"/sys/class/net/{net.inner_if(host)}/statistics/{direction}_bytes"
    return int(subprocess.run(["ip", "netns", "exec", net.ns(host), "cat", path], capture_output=True, text=True,
                              check=True).stdout)


@pytest.mark.slow
@needs_root_and_iproute2
def test_shaped_network_carries_traffic_and_leaves_nothing_behind():
    net = nb.ShapedNetwork(prefix="tnbtest", hosts=2)
    # What a crashed earlier run would have left: a namespace and a link with our names.
    subprocess.run(["ip", "netns", "add", net.ns(5)], check=True)
    subprocess.run(["ip", "link", "add", net.outer_if(7), "type", "veth", "peer", "name", net.inner_if(7)], check=True)
    try:
        net.up()
        assert net.ns(5) not in net.leftovers() and net.outer_if(7) not in net.leftovers()
        net.shape(rate_bps=200_000_000, delay_us=100)
        for ns, dev in net._ends():
            qdiscs = subprocess.run(["tc", *(["-n", ns] if ns else []), "qdisc", "show", "dev", dev],
                                    capture_output=True, text=True, check=True).stdout
            assert "htb" in qdiscs, (dev, qdiscs)
        tx_before, rx_before = counter(net, 1, "tx"), counter(net, 0, "rx")
        server = subprocess.Popen(["ip", "netns", "exec", net.ns(0), sys.executable, "-c", SERVER, net.ip(0)],
                                  stdout=subprocess.PIPE, text=True)
        assert server.stdout.readline().strip() == "listening"
        subprocess.run(["ip", "netns", "exec", net.ns(1), sys.executable, "-c", CLIENT, net.ip(0)], check=True,
                       timeout=60)
        assert server.stdout.readline().strip() == "2000000"
        server.wait(timeout=30)
        assert counter(net, 1, "tx") - tx_before >= 2_000_000  # host 1's link carried it out...
        assert counter(net, 0, "rx") - rx_before >= 2_000_000  # ...and host 0's link in
    finally:
        net.remove_leftovers()
    assert net.leftovers() == []
