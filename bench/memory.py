"""Peak memory of a whole process tree, for benchmarks that count every worker."""

from __future__ import annotations

import contextlib
import threading
import time

import psutil


class PeakMemory:
    """Peak of the summed RSS of a process and all its descendants, sampled every 50 ms; and the peak
    of their private part (RSS less shared file-backed pages, such as memory-mapped Arrow data that
    the kernel can drop and reread), which is what holding data in memory costs."""

    def __init__(self, pid: int) -> None:
        self.root = psutil.Process(pid)
        self.peak = 0
        self.peak_private = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
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
                self.peak_private = max(self.peak_private, private)
            except psutil.Error:
                pass
            time.sleep(0.05)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak
