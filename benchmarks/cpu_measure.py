"""Accounting for the CPU comparisons on a shared machine: load and busy cores, the CPU that other processes took
during a phase, waits for a quiet machine, the machine's description, the engine's commit, RSS / PSS summed over
a process tree, and a server process in its own session. Not run by itself (``cpu_vs_llama_cpp.py`` uses it)."""
from __future__ import annotations

import os
import platform
import signal
import subprocess
import threading
import time

from serve_process import REPO, group_alive, tail


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def cpu_busy_s() -> float:
    """Seconds of CPU time the whole machine has spent busy since boot (all cores, /proc/stat)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    busy = sum(fields[:8]) - fields[3] - fields[4]  # user nice system [idle iowait] irq softirq steal
    return busy / os.sysconf("SC_CLK_TCK")


def tree_cpu_s(pid: int | None) -> float:
    import psutil

    if pid is None:
        return 0.0
    total = 0.0
    try:
        root = psutil.Process(pid)
        for p in (root, *root.children(recursive=True)):
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.NoSuchProcess:
                pass
    except psutil.NoSuchProcess:
        pass
    return total


def own_cpu_s() -> float:
    import resource

    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


class Phase:
    """Records a phase's load average at its start and the CPU that processes other than this benchmark and the
    server under test took during it (in cores), since the machine's cores are shared."""

    def __init__(self, phases: dict, name: str, server_pid: int | None = None) -> None:
        self.phases, self.name, self.pid = phases, name, server_pid

    def __enter__(self) -> "Phase":
        self.load  # noqa: B018 - taken now, at the start
        self.t0, self.busy0 = time.perf_counter(), cpu_busy_s()
        self.tree0, self.own0 = tree_cpu_s(self.pid), own_cpu_s()
        return self

    def __exit__(self, *exc) -> None:
        wall = time.perf_counter() - self.t0
        ours = (tree_cpu_s(self.pid) - self.tree0) + (own_cpu_s() - self.own0)
        others = max(0.0, (cpu_busy_s() - self.busy0) - ours) / max(wall, 1e-9)
        self.phases[self.name] = {"loadavg_at_start": self.load, "wall_s": round(wall, 2),
                                  "other_processes_cpu_cores": round(others, 2)}

    @property
    def load(self) -> list[float]:
        if not hasattr(self, "_load"):
            self._load = loadavg()
        return self._load


def wait_quiet(max_cores: float, timeout: float, window: float = 5.0) -> float:
    """Waits until the whole machine's busy CPU over `window` s is under `max_cores`, at most `timeout` s;
    returns the last window's busy cores."""
    end = time.perf_counter() + timeout
    while True:
        b0, t0 = cpu_busy_s(), time.perf_counter()
        time.sleep(window)
        busy = (cpu_busy_s() - b0) / (time.perf_counter() - t0)
        if busy < max_cores or time.perf_counter() >= end:
            return busy


def machine() -> dict:
    import psutil

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return {"cpu": cpu, "logical_cpus": os.cpu_count(), "ram_gib": round(psutil.virtual_memory().total / 2**30, 1),
            "python": platform.python_version()}


def git_commit() -> str:
    try:
        # The last commit that changed the engine, not the benchmark's own.
        head = subprocess.run(["git", "-C", REPO, "log", "-1", "--format=%h", "--", "pagedllm"], capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--", "pagedllm"], capture_output=True,
                               text=True).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


class MemorySampler(threading.Thread):
    """Sums RSS (and, every few samples, PSS) over a process and all its descendants until stopped."""

    def __init__(self, pid: int, interval: float) -> None:
        super().__init__(daemon=True)
        self.pid, self.interval = pid, interval
        self.stop_event = threading.Event()
        self.serving = False  # set once the server is healthy: its peak is the figure
        self.peak_rss = self.peak_rss_startup = self.peak_pss = 0
        self.samples = 0
        self.max_procs = 0

    def _tree(self):
        import psutil

        try:
            root = psutil.Process(self.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def run(self) -> None:
        import psutil

        n = 0
        while not self.stop_event.is_set():
            procs = self._tree()
            rss = pss = 0
            with_pss = n % 8 == 0
            for p in procs:
                try:
                    if with_pss:
                        info = p.memory_full_info()
                        rss += info.rss
                        pss += getattr(info, "pss", 0)
                    else:
                        rss += p.memory_info().rss
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    pass
            if procs:
                self.samples += 1
                self.max_procs = max(self.max_procs, len(procs))
                if self.serving:
                    self.peak_rss = max(self.peak_rss, rss)
                    self.peak_pss = max(self.peak_pss, pss)
                else:
                    self.peak_rss_startup = max(self.peak_rss_startup, rss)
            n += 1
            self.stop_event.wait(self.interval)

    def stop(self) -> None:
        self.stop_event.set()
        self.join(timeout=10)


class ServerProcess:
    """A server command in its own session (so its children are stopped with it) on a loopback port."""

    def __init__(self, name: str, cmd: list[str], env: dict, port: int, log_path: str, sample_interval: float) -> None:
        self.name, self.cmd, self.port, self.log_path = name, cmd, port, log_path
        self.url = f"http://127.0.0.1:{port}"
        self.log_file = open(log_path, "w")
        self.t_launch = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=self.log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env, start_new_session=True)
        self.memory = MemorySampler(self.proc.pid, sample_interval)
        self.memory.start()

    def wait_healthy(self, timeout: float) -> float:
        import httpx

        while time.perf_counter() - self.t_launch < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}) during start-up; its log "
                                   f"({self.log_path}) ends:\n{tail(self.log_path)}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    self.memory.serving = True
                    return time.perf_counter() - self.t_launch
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"{self.name} was not healthy {timeout:.0f} s after launch; its log ends:\n"
                           f"{tail(self.log_path)}")

    def _group_alive(self) -> bool:
        return group_alive(self.proc.pid)

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM to the whole process group, SIGKILL to what is left after `timeout`."""
        self.memory.stop()
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
            if not self._group_alive():
                break
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            end = time.perf_counter() + wait
            while time.perf_counter() < end:
                self.proc.poll()
                if self.proc.returncode is not None and not self._group_alive():
                    break
                time.sleep(0.1)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        self.log_file.close()
