"""Peak memory of a whole process tree, for benchmarks that count every worker."""

from __future__ import annotations

import contextlib
import threading
import time

import psutil


def anonymous_pss(pid: int) -> int:
    """Bytes of anonymous memory of ``pid``, each page shared with other processes counted in shares
    (``Pss_Anon`` + ``Pss_Shmem``): summed over a tree, forked workers' copy-on-write pages are counted
    once, where RSS counts them in every worker. 0 where the kernel does not say."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            return 1024 * sum(
                int(line.split()[1]) for line in f if line.startswith(("Pss_Anon:", "Pss_Shmem:"))
            )
    except (OSError, ValueError, IndexError):
        return 0


class PeakMemory:
    """Peak of the summed RSS of a process and all its descendants, sampled every 50 ms; the peak of
    their private part (RSS less shared file-backed pages, such as memory-mapped Arrow data that the
    kernel can drop and reread), which is what holding data in memory costs; and, every 250 ms, the
    peak of their anonymous memory counted once (:func:`anonymous_pss`), which the private part
    overstates for workers forked from one server (their shared pages are counted in each)."""

    def __init__(self, pid: int) -> None:
        self.root = psutil.Process(pid)
        self.peak = 0
        self.peak_private = 0
        self.peak_anonymous = 0
        self.peak_root = 0  # the RSS of the process itself (the command: plan, flow and tail run there)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        samples = 0
        while not self._stop.is_set():
            try:
                procs = [self.root, *self.root.children(recursive=True)]
                total = private = 0
                for p in procs:
                    with contextlib.suppress(psutil.Error):
                        info = p.memory_info()
                        total += info.rss
                        private += info.rss - getattr(info, "shared", 0)
                self.peak = max(self.peak, total)
                with contextlib.suppress(psutil.Error):
                    self.peak_root = max(self.peak_root, self.root.memory_info().rss)
                self.peak_private = max(self.peak_private, private)
                if samples % 5 == 0:  # the kernel walks every mapping for this: not every 50 ms
                    self.peak_anonymous = max(self.peak_anonymous, sum(anonymous_pss(p.pid) for p in procs))
            except psutil.Error:
                pass
            samples += 1
            time.sleep(0.05)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak
