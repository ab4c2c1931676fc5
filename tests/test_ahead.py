"""sftmix.runtime.ahead: an iterator read on a thread of its own, as the batch scan and the Parquet spill use it."""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Iterator

import pytest

from sftmix.runtime.ahead import ahead


def _wait_for(condition, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "not within 10 s"
        time.sleep(0.01)


class _Source:
    """A generator's items, counting how many were made and where it was closed."""

    def __init__(self, n: int, fail_at: int | None = None) -> None:
        self.made, self.closed_on = 0, None
        self.n, self.fail_at = n, fail_at

    def items(self) -> Iterator[int]:
        try:
            for k in range(self.n):
                if k == self.fail_at:
                    raise ValueError(f"item {k} cannot be made")
                self.made += 1
                yield k
        finally:
            self.closed_on = threading.current_thread().name


def test_items_in_order_then_the_error_after_them() -> None:
    assert list(ahead(iter(range(50)), 3, "t-order")) == list(range(50))
    source = _Source(10, fail_at=4)
    got = []
    with pytest.raises(ValueError, match="item 4 cannot be made"):
        for item in ahead(source.items(), 2, "t-fail"):
            got.append(item)
    assert got == [0, 1, 2, 3]
    _wait_for(lambda: source.closed_on is not None)
    assert source.closed_on == "t-fail"


@pytest.mark.parametrize("how", ["close", "let go"])
def test_a_reader_that_stops_stops_the_thread_and_closes_the_source(how: str) -> None:
    source = _Source(1000)
    items = ahead(source.items(), 2, f"t-{how}")
    assert next(items) == 0
    _wait_for(lambda: source.made >= 3)
    time.sleep(0.2)
    assert source.made <= 4  # (one given, two queued, one held by the blocked put)
    if how == "close":
        items.close()
    else:
        del items
        gc.collect()
    _wait_for(lambda: source.closed_on is not None)
    assert source.closed_on == f"t-{how}"
    assert source.made <= 4
    _wait_for(lambda: not any(t.name == f"t-{how}" for t in threading.enumerate()))
