"""bench/ack_trace.py cuts a request into the right segments from `perf script` lines: one
request to the daemon, one to the echo server, written as perf prints them."""

from __future__ import annotations

import ack_trace
import pytest

CLIENT, SUPERVISOR, ECHO = 100, 200, 300


def line(tid: int, cpu: int, t: float, event: str, trace: str) -> str:
    return f"{tid:>6} [{cpu:03d}] {t:.6f}: {event}: {trace}"


def send(tid: int, cpu: int, t: float, length: int) -> str:
    return line(tid, cpu, t, "syscalls:sys_enter_sendto",
                f"fd: 0x00000008, buff: 0x7f00, len: {length:#010x}, flags: 0x00000000")


def received(tid: int, cpu: int, t: float) -> str:
    return line(tid, cpu, t, "syscalls:sys_exit_recvfrom", "0x14")


def wakeup(by: int, cpu: int, t: float, pid: int, target: int) -> str:
    return line(by, cpu, t, "sched:sched_wakeup",
                f"comm=python pid={pid} prio=120 target_cpu={target:03d}")


def switch(cpu: int, t: float, prev: str, prev_pid: int, nxt: int) -> str:
    return line(prev_pid, cpu, t, "sched:sched_switch",
                f"prev_comm={prev} prev_pid={prev_pid} prev_prio=120 prev_state=S ==> "
                f"next_comm=python next_pid={nxt} next_prio=120")


def test_a_request_is_cut_into_wake_work_resume_and_read() -> None:
    lines = [
        # to the daemon: its reply wakes the client on the other CPU, idle (swapper)
        send(CLIENT, 0, 10.000000, 80_000),
        wakeup(CLIENT, 0, 10.000010, SUPERVISOR, 1),
        switch(1, 10.000050, "swapper/1", 0, SUPERVISOR),
        received(SUPERVISOR, 1, 10.000100),
        send(SUPERVISOR, 1, 10.000550, 40),
        wakeup(SUPERVISOR, 1, 10.000560, CLIENT, 0),
        switch(0, 10.002550, "swapper/0", 0, CLIENT),
        received(CLIENT, 0, 10.002570),
        send(CLIENT, 0, 10.100000, 100),  # a stats poll: too short to count
        # to the echo server: woken on the server's CPU
        send(CLIENT, 0, 11.000000, 80_000),
        wakeup(CLIENT, 0, 11.000005, ECHO, 0),
        switch(0, 11.000020, "python", CLIENT, ECHO),
        received(ECHO, 0, 11.000030),
        send(ECHO, 0, 11.000300, 40),
        wakeup(ECHO, 0, 11.000305, CLIENT, 0),
        switch(0, 11.000320, "python", ECHO, CLIENT),
        received(CLIENT, 0, 11.000330),
    ]
    results = ack_trace.analyse(lines, [{"set": "resident", "client": CLIENT,
                                         "supervisor": SUPERVISOR, "echo": ECHO}], 4096, 4)
    daemon, echo = results["daemon (resident)"], results["echo"]
    assert daemon["requests"] == 1 and echo["requests"] == 1
    (slow,) = daemon["slowest"]
    assert slow["wake_us"] == pytest.approx(50, abs=1)
    assert slow["work_us"] == pytest.approx(500, abs=1)
    assert slow["resume_us"] == pytest.approx(2000, abs=1)
    assert slow["read_us"] == pytest.approx(20, abs=1)
    assert slow["total_us"] == pytest.approx(2570, abs=1)
    assert slow["held_by"] == "swapper/0" and not slow["same_cpu"]
    assert daemon["client_woken_on_server_cpu"] == 0
    assert echo["client_woken_on_server_cpu"] == 1
    assert echo["resume_p50_us"] == 20 and echo["work_p50_us"] == 280
