"""The measuring tools of issue 23 (tools/thread_times.py, profile_runtime's pair summary) on small inputs."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[3] / "tools"


@pytest.mark.skipif(not Path("/proc/self/schedstat").exists(), reason="needs Linux schedstat")
def test_thread_times_reports_the_busy_thread_of_a_child() -> None:
    busy = "import threading, time\nt0 = time.process_time()\nwhile time.process_time() - t0 < 1.2: pass\n"
    out = subprocess.run([sys.executable, str(TOOLS / "thread_times.py"), sys.executable, "-c", busy],
                         capture_output=True, text=True, check=True, timeout=60).stdout.splitlines()
    assert out[0].split()[:3] == ["pid", "tid", "thread"]
    rows = [line.split() for line in out[1:]]
    assert rows, "no thread of the child was read"
    on_cpu = float(rows[0][3])
    assert 0.5 <= on_cpu <= 5.0  # the spinning main thread, read at most 0.5 s before it ended


def test_thread_times_needs_a_command() -> None:
    r = subprocess.run([sys.executable, str(TOOLS / "thread_times.py")], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "usage" in r.stderr


def test_pair_summary_is_the_loop_over_the_runtime(capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("profile_runtime", TOOLS / "profile_runtime.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.print_pairs({"runtime": [2.0, 1.0, 4.0], "loop": [1.0, 1.0, 5.0]}, "native")
    last = capsys.readouterr().out.splitlines()[-1]
    assert "[0.5, 1.0, 1.25]" in last and "median 1.000" in last  # tokens/s ratio = loop time / runtime time


def test_bench_heap_settings_parse_and_refuse_in_one_line() -> None:
    spec = importlib.util.spec_from_file_location("bench_heap", TOOLS / "bench_heap.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.parse_setting("0") == (0, "", 0)
    assert mod.parse_setting("1024t") == (1024, "t", 0)
    assert mod.parse_setting("0sr64") == (0, "s", 64)
    with pytest.raises(ValueError, match="setting 'x1'"):
        mod.parse_setting("x1")
    r = subprocess.run([sys.executable, str(TOOLS / "bench_heap.py"), "--settings", "0,64q"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "setting '64q'" in r.stderr and "Traceback" not in r.stderr
