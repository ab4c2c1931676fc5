"""The OLMo-core simulation's packing count against a plain best-fit-decreasing packer, one document
at a time (the way OLMo-core's InstancePacker places them); test_olmo_core checks both against
OLMo-core itself."""

from __future__ import annotations

import numpy as np
import pytest

from sftmix.check.olmo_fit import OlmoCoreFit, best_fit_decreasing_bins, capped_lengths


def one_at_a_time(lengths: list[int], capacity: int) -> int:
    rooms: list[int] = []  # room left in each open instance
    for length in sorted(lengths, reverse=True):
        fitting = [i for i, room in enumerate(rooms) if room >= length]
        if fitting:
            best = min(fitting, key=lambda i: rooms[i])
            rooms[best] -= length
        else:
            rooms.append(capacity - length)
    return len(rooms)


@pytest.mark.parametrize("seed", range(40))
def test_grouped_packing_counts_what_one_document_at_a_time_counts(seed):
    rng = np.random.default_rng(seed)
    capacity = int(rng.choice([8, 16, 64, 256, 300, 1024, 4096]))
    n = int(rng.integers(1, 400))
    shape = seed % 4
    if shape == 0:  # anything
        lengths = rng.integers(1, capacity + 1, n)
    elif shape == 1:  # few distinct lengths: long runs of one length
        lengths = rng.choice(rng.integers(1, capacity + 1, 4), n)
    elif shape == 2:  # short documents, many to an instance
        lengths = rng.integers(1, max(2, capacity // 8), n)
    else:  # around half the capacity, where best fit is most sensitive
        lengths = np.clip(rng.integers(capacity // 2 - 3, capacity // 2 + 4, n), 1, capacity)
    assert best_fit_decreasing_bins(lengths, capacity) == one_at_a_time(lengths.tolist(), capacity)


def test_long_documents_are_truncated_or_fragmented_as_olmo_core_does():
    lengths = np.array([5, 10, 23, 8])
    truncated, dropped = capped_lengths(lengths, 8, "truncate")
    assert truncated.tolist() == [5, 8, 8, 8] and dropped == 2 + 15
    fragmented, dropped = capped_lengths(lengths, 8, "fragment")
    assert sorted(fragmented.tolist()) == sorted([5, 8, 2, 8, 8, 7, 8]) and dropped == 0


def test_plain_and_eos_boundaries_of_a_part():
    # documents [0,5) [5,12) [12,20): EOS at 4, 11 and inside the last one at 15; no EOS at its end
    fit = OlmoCoreFit(8, "truncate")
    fit.add_part(np.array([0, 5, 12]), np.array([5, 12, 20]), 20, np.array([4, 11, 15]))
    assert fit.fsl_instances == 2 and fit.fsl_tokens_dropped == 4
    assert fit.fsl_documents_cut == 1  # [5,12) runs across the boundary at 8
    assert fit.packed.documents == 3 and fit.packed.tokens_truncated == 0
    assert fit.packed_by_eos.documents == 3  # [0,5) [5,12) [12,16); the last 4 tokens are never read
    assert fit.packed_by_eos.tokens_unread == 4
    assert fit.packable and not OlmoCoreFit(100, "truncate").packable
