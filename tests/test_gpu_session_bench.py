"""bench/gpu_session.py runs end to end on the CPU (``--device cpu --tiny``, gloo): every part, every rank in
its own process, results appended as they come and the summary written at the end. The GPU-only jobs
(``"cuda:gloo"``, the sanitizer) are reported as skipped; everything else takes the code paths it takes on a
GPU, at tiny shapes."""

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench" / "gpu_session.py"


def test_the_session_runs_every_part_on_the_cpu_and_parity_passes(tmp_path):
    out = tmp_path / "session"
    done = subprocess.run([sys.executable, str(BENCH), "--device", "cpu", "--tiny", "--out", str(out),
                           "--budget-s", "400"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = (out / "summary.md").read_text()
    assert summary == done.stdout[done.stdout.index("# shardwise GPU session"):], "the summary is what was printed"
    for heading in ("## parity", "## sanitizer: CUDA only, skipped", "## speed", "## offload", "## qlora"):
        assert heading in summary, heading
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    parity = [r for r in records if r["job"].startswith("parity-")]
    assert {r["job"] for r in parity} == {"parity-w1", "parity-w2-gloo"}
    assert len(parity) == 2 * 10 and all(r["status"] == "ok" and r["pass"] for r in parity), parity
    timed = {r["job"].rsplit("-", 1)[0] if r["job"].startswith("speed") else r["job"]: r for r in records
             if "median_s" in r}
    assert set(timed) == {"speed-shardwise", "speed-fsdp2", "speed-plain", "offload-shardwise", "offload-fsdp2",
                          "qlora-bf16", "qlora-nf4"}, sorted(timed)
    assert timed["qlora-nf4"]["dequant_bits_equal_cpu"] is True
    assert not [r for r in records if r.get("status", "ok") not in ("ok",)], "no job failed, timed out or was skipped"
    assert "failed" not in summary and "not run" not in summary
