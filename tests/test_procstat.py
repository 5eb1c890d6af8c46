"""bench/procstat.py: the processes of a local swarm's peers sorted into kinds, and their CPU seconds over a window."""

import os

import pytest

from bench.procstat import Proc, Sample, by_kind, classify, cpu_between, read_table


def _table(**cpu):
    rows = [Proc(10, 1, 10, "python", cpu.get("server", 1.0)),  # a server's main process (its session's leader)
            Proc(11, 10, 10, "python", 2.0), Proc(12, 11, 10, "p2pd", 3.0),  # its DHT process and that one's p2pd
            Proc(13, 10, 10, "python", 4.0), Proc(14, 10, 10, "torch_shm_manag", 0.5),  # an averager; torch's helper
            Proc(20, 1, 20, "python", 1.5), Proc(21, 20, 20, "python", 2.5), Proc(22, 21, 20, "p2pd", 3.5),  # trainer
            Proc(30, 1, 30, "python", 9.0)]  # not a peer of the swarm
    return {p.pid: p for p in rows}


def test_processes_are_sorted_into_kinds_by_session_and_ancestry():
    kinds = classify(_table(), {10: "server", 20: "trainer"})
    assert kinds == {10: (10, "server"), 11: (10, "dht"), 12: (10, "p2pd"), 13: (10, "averager"), 14: (10, "other"),
                     20: (20, "trainer"), 21: (20, "dht"), 22: (20, "p2pd")}


def test_cpu_over_a_window_counts_newborn_processes_from_zero_and_a_reused_pid_as_new():
    leaders = {10: "server", 20: "trainer"}
    first = Sample(0.0, _table(), classify(_table(), leaders))
    later = _table(server=1.75)
    later[15] = Proc(15, 10, 10, "python", 0.25)  # an averager born in the window
    later[13] = Proc(13, 10, 10, "python", 0.5, start=99)  # pid 13 died and was reused by another process
    used = cpu_between(first, Sample(10.0, later, classify(later, leaders)))
    assert used[(10, "server")] == 0.75 and used[(10, "averager")] == 0.75 and used[(20, "trainer")] == 0.0
    assert by_kind(used)["averager"] == 0.75 and by_kind(used, [20])["server"] == 0.0


def test_the_table_reads_this_process():
    me = read_table()[os.getpid()]
    assert me.cpu_s >= 0 and me.ppid == os.getppid() and me.sid == os.getsid(0)


def test_memory_and_io_of_this_process_are_read_from_proc():
    """This process's session: resident bytes at least its proportional share, both above zero; its I/O counters grow
    when it writes (a pipe)."""
    from bench.procstat import io_bytes, memory_by_session

    rss, pss = memory_by_session([os.getsid(0)])[os.getsid(0)]
    assert rss >= pss > 0
    before = io_bytes([os.getpid()])[os.getpid()]
    read_end, write_end = os.pipe()
    os.write(write_end, b"x" * 4096)
    os.read(read_end, 4096)
    os.close(read_end), os.close(write_end)
    assert io_bytes([os.getpid()])[os.getpid()] >= before + 8192
    assert io_bytes([2**22 + 1]) == {}  # no such process


def test_the_machine_s_cpu_counts_busy_and_idle_seconds_that_grow_with_work(tmp_path):
    """machine_cpu reads /proc/stat's ``cpu`` line (ticks to seconds); on this machine each figure only grows, and a
    busy loop in this process adds at least its own CPU seconds to the busy one."""
    from bench.procstat import TICK_S, machine_cpu

    (tmp_path / "stat").write_text("cpu  100 5 20 300 10 1 2 3 0 0\ncpu0 100 5 20 300 10 1 2 3 0 0\n")
    assert machine_cpu(tmp_path) == (pytest.approx(128 * TICK_S), pytest.approx(310 * TICK_S),
                                     pytest.approx(3 * TICK_S))
    busy, idle, steal = machine_cpu()
    spin = os.times()
    while os.times().user - spin.user < 0.2:
        pass
    after_busy, after_idle, after_steal = machine_cpu()
    assert after_busy - busy >= 0.2 - 2 * TICK_S and after_idle >= idle and after_steal >= steal
